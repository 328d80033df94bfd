# How a recipe learns that a run stopped to be resumed (sourced by the recipes).
# The trainer exits 3 when it saved and stopped before its end (a signal, or a step that could not
# finish and save before --exit-duration-in-mins or Slurm's time limit) and writes
# SAVE_DIR/stopped_to_resume.json. torchrun turns any non-zero worker status into its own 1, so the
# file decides there; it is removed before each launch, so that one left by an earlier run is never
# taken for this one's.
RESUME_STATUS=3

# before_launch SAVE_DIR: call just before launching a run that saves into SAVE_DIR.
before_launch() {
    rm -f "$1/stopped_to_resume.json"
}

# stopped_to_resume STATUS SAVE_DIR: true when the run that exited with STATUS stopped to be resumed.
stopped_to_resume() {
    [ "$1" -eq "$RESUME_STATUS" ] || { [ "$1" -ne 0 ] && [ -f "$2/stopped_to_resume.json" ]; }
}
