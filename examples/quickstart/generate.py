"""Load a converted model with transformers alone and continue a prompt (greedy)."""

import sys

import torch
import transformers


def main(model_dir: str, prompt: str, new_tokens: int = 24, chat: bool = False) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    if chat:  # the prompt as a user turn, rendered by the tokenizer's own chat template
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    print(f"transformers loaded {type(model).__name__} from {model_dir}")
    print(f"prompt: {prompt!r}\ncontinuation: {tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    chat = "--chat" in sys.argv[1:]  # generate.py MODEL_DIR PROMPT [--chat]
    words = [a for a in sys.argv[1:] if a != "--chat"]
    main(words[0], words[1] if len(words) > 1 else "The ", chat=chat)
