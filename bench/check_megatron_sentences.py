#!/usr/bin/env python3
"""--split-sentences (with and without --keep-newlines) against Megatron-LM's own tool, byte for byte.

    python bench/check_megatron_sentences.py --megatron-lm /path/to/Megatron-LM --work-dir /tmp/sscheck

Needs nltk, and a Megatron-LM checkout at core_v0.16.1 (run through bench/megatron_preprocess.py against
the installed megatron-core). It trains a Punkt model and a SentencePiece model here (nothing downloaded),
installs the Punkt model as punkt_tab under WORK_DIR/home/nltk_data (Megatron-LM's tool finds it there
through HOME: with NLTK_DATA set it opens a pickle instead), writes 200 JSON-lines documents, runs
Megatron-LM's tool twice (with one partition it splits in its first run and encodes in its second) and
this tool once, and compares the PREFIX_text_sentence.bin/.idx files.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

TRAINING_TEXT = " ".join(
    ["Dr. Smith went to Washington. He arrived on Jan. 5 at noon. The U.S. team won again.",
     "Mr. Brown said no. It rained all day. Prof. Lee agreed, e.g. on the main points."] * 40)
SENTENCES = ["Dr. Smith went to Washington.", "He arrived at noon.", "Is this a question?", "Yes!",
             "Mr. Brown said so.", "The U.S. team won.", "It rained all day", "e.g. this one.",
             "Lists:\n- first item.", "Done."]


def install_punkt(nltk_data: Path) -> None:
    from nltk.tabdata import TabEncoder
    from nltk.tokenize.punkt import PunktTrainer

    trainer = PunktTrainer()
    trainer.train(TRAINING_TEXT, finalize=True)
    params, encoder = trainer.get_params(), TabEncoder()
    lang_dir = nltk_data / "tokenizers" / "punkt_tab" / "english"
    lang_dir.mkdir(parents=True, exist_ok=True)
    (lang_dir / "collocations.tab").write_text(encoder.tups2tab(params.collocations))
    (lang_dir / "sent_starters.txt").write_text(encoder.set2txt(params.sent_starters))
    (lang_dir / "abbrev_types.txt").write_text(encoder.set2txt(params.abbrev_types))
    (lang_dir / "ortho_context.tab").write_text(encoder.ivdict2tab(params.ortho_context))


def write_corpus(path: Path, count: int = 200) -> list[str]:
    rng = random.Random(0)
    docs = ["".join(rng.choice(SENTENCES) + rng.choice([" ", "\n", "\n\n", "  "]) for _ in range(rng.randint(1, 12)))
            for _ in range(count)]
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True)
    parser.add_argument("--work-dir", default="/tmp/sscheck")
    args = parser.parse_args()
    from megatron_lc.data.tokenizers import train_sentencepiece

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    install_punkt(work / "home" / "nltk_data")
    docs = write_corpus(work / "in.jsonl")
    model = train_sentencepiece([line for d in docs for line in d.splitlines() if line.strip()] * 3,
                                work / "spm", vocab_size=400)
    env = {**os.environ, "HOME": str(work / "home"), "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("NLTK_DATA", None)
    common = ["--input", str(work / "in.jsonl"), "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              model, "--workers", "1", "--append-eod", "--split-sentences"]
    failures = 0
    for extra in ([], ["--keep-newlines"]):
        (work / "in_ss.jsonl").unlink(missing_ok=True)
        for _ in range(2):
            subprocess.run([sys.executable, str(REPO / "bench" / "megatron_preprocess.py"), args.megatron_lm,
                            *common, *extra, "--output-prefix", str(work / "megatron")], env=env, check=True,
                           capture_output=True)
        subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), *common, *extra,
                        "--output-prefix", str(work / "ours"), "--no-progress"], env=env, check=True,
                       capture_output=True)
        same = all(filecmp.cmp(work / f"megatron_text_sentence{s}", work / f"ours_text_sentence{s}", shallow=False)
                   for s in (".bin", ".idx"))
        failures += not same
        size = (work / "ours_text_sentence.bin").stat().st_size
        print(f"--split-sentences {' '.join(extra)}: {'identical' if same else 'DIFFERENT'} ({size:,} bytes of tokens)")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
