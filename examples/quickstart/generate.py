"""Load a converted model with transformers alone and continue a prompt (greedy)."""

import sys

import torch
import transformers


def main(model_dir: str, prompt: str, new_tokens: int = 24) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    print(f"transformers loaded {type(model).__name__} from {model_dir}")
    print(f"prompt: {prompt!r}\ncontinuation: {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "The ")
