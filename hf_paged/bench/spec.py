"""``hf-paged bench spec``: speculative decoding against the same engine without it (docs/benchmarks.md).

Copy-heavy chat prompts (repeat or lightly edit a given text) on the default model, greedy, up to 256 new
tokens (``--spec-prompts chat``: the 64 prompts of ``bench chat``, up to 128), stopping at EOS like a real request (greedy speculation emits exactly the tokens plain decoding
emits, so every system does the same work; ``ignore_eos=True`` measures the model's made-up continuation
after its answer instead). Batch 1 runs the first prompts one at a time; batch 16 and batch 64 submit that
many at once (``batches`` picks which). Speed-ups are tokens per second over the engine without speculation,
measured in the same run; mean acceptance length is 1 + accepted drafts per verification.

With ``eagle_head`` (a head folder) the ``eagle`` system drafts with it: ``"eagle3"`` or ``"eagle"`` as its
``config.json`` says (EAGLE-1 heads name ``EagleLlamaForCausalLM``), k = 3 unless ``eagle_k`` says otherwise.
Every system runs with its default ``disable_by_batch_size="auto"``: each result says how many steps the
speculation gate kept plain.
"""

from __future__ import annotations

import json
import os
import time

from hf_paged import PagedGenerator, SamplingParams
from hf_paged.bench.common import load_chat_messages, machine_info
from hf_paged.model.default_model import load_default, parse_dtype

# Four passages of about 300 tokens each, so that copying them covers the 256 tokens generated.
TEXTS = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a tin of oil and a soft cloth. "
    "He polished the great lens until it gleamed, trimmed the wick, and watched the first ships come home across the "
    "grey water. In winter the wind rattled the windows and the spray froze on the railings, but he never missed a "
    "night. He kept a logbook on the desk by the lamp, and in it he wrote the name of every vessel he saw, the hour "
    "it passed, and the state of the sea. Some nights there were a dozen fishing boats, their small lights bobbing "
    "like fireflies; other nights there was only a single freighter, moving slowly and steadily toward the harbour. "
    "When fog rolled in from the east he wound the clockwork of the foghorn and counted the seconds between each "
    "long, mournful blast. His daughter brought him bread and soup on Sundays and stayed to hear his stories about "
    "storms and shipwrecks and the year the ice closed the bay for a whole month. When he finally retired, the town "
    "held a supper in his honour, and the mayor read aloud a page from the old logbook while everyone listened.",
    "To bake a simple country loaf, mix four cups of flour with a spoonful of salt in a large bowl. In a jug, stir a "
    "packet of yeast into two cups of warm water with a pinch of sugar and leave it for ten minutes until it foams. "
    "Pour the yeast into the flour and stir with a wooden spoon until a shaggy dough forms. Turn the dough onto a "
    "floured table and knead it for ten minutes, pushing it away with the heel of your hand and folding it back, "
    "until it is smooth and springs back when you press it. Put the dough in an oiled bowl, cover it with a damp "
    "towel, and let it rise in a warm place for about an hour, until it has doubled in size. Punch it down gently, "
    "shape it into a round loaf, and place it on a tray dusted with flour. Cover it again and let it rise for "
    "another forty minutes while the oven heats to a high temperature. Slash the top of the loaf with a sharp knife, "
    "brush it with a little water, and bake it for thirty five minutes, until the crust is deep brown and the loaf "
    "sounds hollow when you tap the bottom. Let it cool on a rack for at least half an hour before slicing it.",
    "The town committee met on Tuesday evening in the old school hall to review the budget for the coming year. "
    "The treasurer opened the meeting with a summary of income and spending, noting that the fair had raised more "
    "money than expected and that the repairs to the bridge had cost less than planned. After a long discussion the "
    "members agreed to fund the new wing of the library, which will hold a reading room for children and a small "
    "room for local history. They decided to delay the repairs to the north road until spring, when the weather "
    "will allow the work to be done properly, and to hire two more teachers for the primary school, where classes "
    "have grown larger every year. A resident asked whether the swimming pool would open earlier in the summer, and "
    "the committee promised to look into the cost of extra lifeguards. The meeting ended with a vote of thanks to "
    "the volunteers who had painted the hall and repaired the chairs. The next meeting will take place on the first "
    "Tuesday of next month, and the minutes will be posted on the notice board outside the post office.",
    "A small red fox crept along the hedge at dawn, pausing at every rustle in the grass. The field was still white "
    "with frost, and its breath made little clouds in the cold air. It found a fallen apple under the old tree at "
    "the corner of the orchard and ate it slowly, watching the farmhouse the whole time. A blackbird scolded it from "
    "the branches above, and a rabbit froze at the edge of the ditch, then bolted for its burrow. The fox ignored "
    "them both. When the light in the kitchen window came on, it trotted along the stone wall, jumped down into the "
    "lane, and followed the stream toward the woods. There, under the roots of a fallen beech, its four cubs were "
    "waiting, tumbling over each other and yapping for food. The fox lay down at the entrance of the den and let "
    "them climb over her while the sun rose over the hill. Later that morning the farmer opened the barn door, "
    "counted his hens, and found them all safe, and he never knew how close the fox had come to his yard that day.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Copy this paragraph twice, separated by a blank line:\n\n{}",
    "Rewrite the following text, changing only the tense to the present:\n\n{}",
    "Repeat this text, then repeat it again in capital letters:\n\n{}",
]


def spec_prompts(tokenizer, n: int = 16) -> list[list[int]]:
    chats = [INSTRUCTIONS[(i // len(TEXTS)) % len(INSTRUCTIONS)].format(TEXTS[i % len(TEXTS)]) for i in range(n)]
    # past the 16 combinations a label keeps each prompt distinct (no prefix-cache hit on a whole prompt)
    chats = [c if i < 16 else f"(Request {i}.) {c}" for i, c in enumerate(chats)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for c in chats]


SYSTEMS = {
    "no_spec": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4},
    "self_draft": {"method": "draft_model", "model": "self:20", "num_speculative_tokens": 3},
}


def eagle_system(folder: str, k: int = 3) -> dict:
    """The speculative config of the ``eagle`` system: the head in ``folder`` (ValueError: no head folder)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--eagle-head {folder!r}: not an EAGLE head folder (no config.json)")
    with open(path) as f:
        arch = json.load(f).get("architectures") or []
    method = "eagle" if "EagleLlamaForCausalLM" in arch else "eagle3"
    return {"method": method, "model": folder, "num_speculative_tokens": k}


def _run(model, tok, prompts, spec, one_at_a_time: bool, max_tokens: int, ignore_eos: bool) -> dict:
    engine = PagedGenerator(model, tok, max_num_seqs=max(16, len(prompts)), speculative_config=spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    engine.kv_manager.reset_prefix_cache()
    base = engine.stats()
    start = time.perf_counter()
    if one_at_a_time:
        outs = [engine.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = engine.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = engine.stats()
    gate = engine.scheduler.spec_gate.summary()
    engine.close()
    drafted = stats.spec_num_draft_tokens - base.spec_num_draft_tokens
    accepted = stats.spec_num_accepted_tokens - base.spec_num_accepted_tokens
    verifications = stats.spec_num_drafts - base.spec_num_drafts
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "seconds": round(seconds, 2), "tok_per_s": round(tokens / seconds, 2),
            "acceptance": round(accepted / drafted, 3) if drafted else None, "draft_tokens": drafted,
            "mean_acceptance_length": round(1 + accepted / verifications, 3) if verifications else None,
            "gate": gate, "outputs": [o.token_ids for o in outs]}


def chat_prompt_ids(tokenizer, n: int = 64) -> list[list[int]]:
    """The first ``n`` prompts of ``bench chat`` (its 64 chats, the chat template applied)."""
    return [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
            for m in load_chat_messages()[:n]]


def spec(dtype: str = "fp32", repeat: int = 1, systems: set[str] | None = None, max_tokens: int | None = None,
         batch1_prompts: int | None = None, ignore_eos: bool = False, eagle_head: str | None = None,
         batches: tuple[int, ...] = (1, 16), prompt_set: str = "copy", eagle_k: int = 3, **_) -> dict:
    """Each wanted system at each batch size (see the module docstring). ``prompt_set``: ``"copy"`` (copy-heavy
    prompts, 256 new tokens, batch 1 over 4 of them) or ``"chat"`` (``bench chat``'s prompts, EOS or 128 new
    tokens, batch 1 over the first 8)."""
    if prompt_set not in ("copy", "chat"):
        raise ValueError(f"bench spec prompt_set {prompt_set!r}: expected 'copy' or 'chat'")
    all_systems = dict(SYSTEMS)
    if eagle_head is not None:
        all_systems["eagle"] = eagle_system(eagle_head, eagle_k)
    bad = [b for b in batches if b not in (1, 16, 64)]
    if bad:
        raise ValueError(f"bench spec batch sizes {bad}: expected 1, 16 or 64")
    model, tok = load_default(parse_dtype(dtype))
    chat = prompt_set == "chat"
    max_tokens = max_tokens or (128 if chat else 256)
    batch1_prompts = batch1_prompts or (8 if chat else 4)
    prompts = chat_prompt_ids(tok) if chat else spec_prompts(tok, max(16, *batches))
    want = [s for s in all_systems if systems is None or s in systems or (s == "eagle" and eagle_head)]
    table = {}
    # batch 1: copy prompts: one of each instruction and passage (0, 5, 10, 15); chat: the first ones.
    # batch 16 / 64: that many at once
    for batch in batches:
        first = prompts[:batch1_prompts] if chat else prompts[::5][:batch1_prompts]
        group, alone = (first, True) if batch == 1 else (prompts[:batch], False)
        for name in want:
            runs = [_run(model, tok, group, all_systems[name], alone, max_tokens, ignore_eos) for _ in range(max(1, repeat))]
            table[(batch, name)] = min(runs, key=lambda r: r["seconds"])
    print(f"\n== hf-paged bench spec ({dtype}, {prompt_set} prompts, at most {max_tokens} new tokens, greedy, "
          f"{'EOS ignored' if ignore_eos else 'stop at EOS'}) ==")
    print(f"{'batch':>5} {'system':<18} {'tokens':>7} {'time s':>8} {'tok/s':>8} {'speed-up':>9} {'acceptance':>11} "
          f"{'mean len':>9} {'same tokens':>12}")
    payload = {"workload": "spec", "dtype": dtype, "results": {}, "machine": machine_info(),
               "eagle_head": eagle_head, "prompt_set": prompt_set, "eagle_k": eagle_k if eagle_head else None}
    for (batch, name), r in table.items():
        ref = table.get((batch, "no_spec"))
        speedup = r["tok_per_s"] / ref["tok_per_s"] if ref else float("nan")
        same = f"{sum(a == b for a, b in zip(r['outputs'], ref['outputs']))}/{len(r['outputs'])}" if ref else "-"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        mal = "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
        print(f"{batch:>5} {name:<18} {r['tokens']:>7} {r['seconds']:>8.2f} {r['tok_per_s']:>8.1f} {speedup:>8.2f}x {acc:>11} "
              f"{mal:>9} {same:>12}")
        payload["results"][f"batch{batch}/{name}"] = {k: v for k, v in r.items() if k != "outputs"} | {
            "speedup": round(speedup, 3), "same_tokens_as_no_spec": same}
    print(json.dumps(payload))
    return payload
