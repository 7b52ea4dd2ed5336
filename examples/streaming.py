"""Stream tokens as they are generated, two ways: the engine's `stream()` and HF's `TextIteratorStreamer`."""

import argparse
import threading

from transformers import TextIteratorStreamer

import hf_paged
from hf_paged.model.default_model import load_default


def main(max_new_tokens: int = 48) -> tuple[str, str]:
    model, tok = load_default()
    hf_paged.wrap(model, tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a short story about a fox."}], add_generation_prompt=True, tokenize=True, return_dict=False)
    params = hf_paged.SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    engine_text = ""
    for delta in model.paged.stream(prompt, params):
        print(delta.text, end="", flush=True)
        engine_text += delta.text
    print("\n---")
    # The HF way: generate in a thread, read text pieces from the streamer as they arrive.
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    inputs = tok.apply_chat_template([{"role": "user", "content": "Tell me a short story about a fox."}], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    thread = threading.Thread(target=model.generate, kwargs=dict(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer))
    thread.start()
    hf_text = ""
    for piece in streamer:
        print(piece, end="", flush=True)
        hf_text += piece
    thread.join()
    print()
    hf_paged.unwrap(model)
    return engine_text, hf_text


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    main(parser.parse_args().max_new_tokens)
