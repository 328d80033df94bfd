#!/usr/bin/env python3
"""Run Megatron-LM's `tools/preprocess_data.py` from a checkout, against the installed megatron-core.

The tool imports two things from `megatron.training` (whose package needs GPU libraries
to import): the legacy tokenizer builder, unused with the default tokenizer system, and
`_add_tokenizer_args`, taken here from the checkout's `arguments.py`.

    python bench/megatron_preprocess.py MEGATRON_LM_DIR --input ... --output-prefix ... [tool flags]
"""

import ast
import os
import runpy
import sys
import types


def tokenizer_args_function(megatron_dir: str):
    """`_add_tokenizer_args` from the checkout's megatron/training/arguments.py."""
    path = os.path.join(megatron_dir, "megatron", "training", "arguments.py")
    with open(path, encoding="utf-8") as stream:
        source = stream.read()
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_add_tokenizer_args")
    namespace: dict = {}
    exec("import argparse\n" + ast.get_source_segment(source, node), namespace)
    return namespace["_add_tokenizer_args"]


def install_training_modules(megatron_dir: str) -> None:
    training = types.ModuleType("megatron.training")
    training.__path__ = []
    tokenizer = types.ModuleType("megatron.training.tokenizer")

    def legacy_build_tokenizer(*args, **kwargs):
        raise RuntimeError("the legacy tokenizer system is not available here")

    tokenizer.build_tokenizer = legacy_build_tokenizer
    arguments = types.ModuleType("megatron.training.arguments")
    arguments._add_tokenizer_args = tokenizer_args_function(megatron_dir)
    sys.modules["megatron.training"] = training
    sys.modules["megatron.training.tokenizer"] = tokenizer
    sys.modules["megatron.training.arguments"] = arguments


def main() -> None:
    megatron_dir = sys.argv[1]
    install_training_modules(megatron_dir)
    sys.argv = ["preprocess_data.py", *sys.argv[2:]]
    runpy.run_path(os.path.join(megatron_dir, "tools", "preprocess_data.py"), run_name="__main__")


if __name__ == "__main__":
    main()
