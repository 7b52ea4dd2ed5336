"""`pipeline("text-generation")` over a wrapped model: a list of chats runs as one continuous batch."""

import argparse

import hf_paged
from hf_paged.model.default_model import default_model_path


def main(max_new_tokens: int = 48) -> list:
    chat = hf_paged.pipeline(str(default_model_path()))  # loads, wraps, returns a stock text-generation pipeline
    chats = [
        [{"role": "user", "content": "Write a haiku about tea."}],
        [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "Why is the sky blue?"}],
    ]
    results = chat(chats, max_new_tokens=max_new_tokens, do_sample=False)
    for result in results:
        print(result[0]["generated_text"][-1]["content"], "\n")
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    main(parser.parse_args().max_new_tokens)
