# run MODULE [flags...]: one process per GPU under torchrun (GPUS_PER_NODE of them), or a single process when
# LAUNCH=python (the CPU tests run the recipes that way). Sourced by the single-node recipes.
run() {
    if [ "${LAUNCH:-torchrun}" = torchrun ]; then
        torchrun --nproc-per-node "$GPUS_PER_NODE" -m "$@"
    else
        python -m "$@"
    fi
}
