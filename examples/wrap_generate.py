"""Wrap a model and call the stock `generate` API on a left-padded batch: all rows run as one paged batch."""

import argparse

import hf_paged
from hf_paged.model.default_model import load_default


def main(max_new_tokens: int = 48) -> list[str]:
    model, tok = load_default()
    hf_paged.wrap(model, tok)
    questions = ["What is the capital of France?", "Name a fruit that is yellow.", "Say hi in Spanish."]
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False) for q in questions]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    answers = tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    for q, a in zip(questions, answers):
        print(f"Q: {q}\nA: {a.strip()}\n")
    hf_paged.unwrap(model)
    return answers


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    main(parser.parse_args().max_new_tokens)
