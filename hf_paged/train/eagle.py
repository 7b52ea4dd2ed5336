"""Distil an EAGLE-3 head from a target model (``hf-paged train-eagle``).

1. Text: the engine answers prompts (greedy and sampled); the target's hidden states over it are recorded
   (:mod:`hf_paged.train.eagle_data`). Both are cached in ``OUT/train_data.pt``.
2. The draft vocabulary: the most frequent tokens of that text (``d2t``/``t2d``). The head starts from the
   target: ``lm_head`` rows of those tokens, the final norm, and the target's embedding (shared, not saved).
3. Training: soft targets (the target's distribution over the draft vocabulary at each position), and
   ``ttt_steps`` unrolled steps ("training-time test"): step ``j`` feeds the head its own outputs of step
   ``j - 1`` one position back, and each query attends as it will when drafting: to the head's keys from the
   target's states up to ``p - j``, then to its own keys of steps ``1 .. j`` (one each). Step ``j``'s loss
   weighs ``0.8 ** j``. AdamW, one text per step, a progress bar.
4. ``OUT/trainer_state.pt`` (head, optimizer, step) is saved every ``save_every`` steps and at the end, and a run
   on the same ``OUT`` resumes from it; the head is written to ``OUT`` in the layout :func:`load_head` reads.
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass

import torch

from hf_paged.spec_decode.eagle.head import EagleHead, EagleHeadConfig
from hf_paged.spec_decode.eagle.loading import aux_layers, save_head
from hf_paged.train import eagle_data as train_data

logger = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Settings of a training run (the data part must match to reuse a cache)."""

    tokens: int = 20000  # answer tokens to generate
    max_tokens: int = 192  # longest answer
    draft_vocab_size: int = 8192
    epochs: int = 2
    ttt_steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    save_every: int = 200
    max_steps: int | None = None  # stop after this many steps in all (a later run resumes)
    greedy_first: bool = False  # answer every prompt greedily first, then sample (default: alternate)
    init_layer: bool = True  # start the head's layer from the target's last decoder layer (else at random)

    def __post_init__(self) -> None:
        for name in ("tokens", "max_tokens", "draft_vocab_size", "epochs", "ttt_steps", "save_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train-eagle {name} must be an int >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"train-eagle lr must be > 0, got {self.lr!r}")


def head_config_for(model: torch.nn.Module, draft_vocab_size: int) -> EagleHeadConfig:
    """A head shaped after the target: its hidden size, heads, MLP width, RoPE and norm settings."""
    from hf_paged.model.hf_config import text_config

    cfg = text_config(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    return EagleHeadConfig(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=getattr(cfg, "num_key_value_heads", None), head_dim=getattr(cfg, "head_dim", None),
        intermediate_size=cfg.intermediate_size, vocab_size=vocab, draft_vocab_size=min(draft_vocab_size, vocab),
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-6), hidden_act=getattr(cfg, "hidden_act", "silu"),
        rope_theta=getattr(cfg, "rope_theta", None) or 10000.0, rope_scaling=getattr(cfg, "rope_scaling", None),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 2048),
        target_hidden_size=cfg.hidden_size)


def init_head(model: torch.nn.Module, config: EagleHeadConfig, vocab: torch.Tensor, seed: int) -> EagleHead:
    """A new head: random layer (std 0.02), ``lm_head`` and ``norm`` from the target, the target's embedding."""
    torch.manual_seed(seed)
    head = EagleHead(config, model.get_input_embeddings())
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[vocab].float())
        final_norm = getattr(model.get_decoder(), "norm", None)
        if final_norm is not None and getattr(final_norm, "weight", None) is not None:
            head.norm.weight.copy_(final_norm.weight.float())
        head.d2t.copy_(vocab - torch.arange(len(vocab)))
        head.t2d.zero_()
        head.t2d[vocab] = True
    return head


def copy_last_layer(model: torch.nn.Module, head: EagleHead) -> bool:
    """Start the head's layer from the target's last decoder layer (False where the shapes or names differ).

    The attention projections read ``[embedding, hidden]`` (2H): both halves start as the target's weight, so
    the layer first sees the sum of the two as the target's layer would see one hidden state."""
    from hf_paged.executor.step_runners import decoder_layers

    last = decoder_layers(model)[-1]
    mid = head.midlayer
    try:
        pairs = [(mid.self_attn.o_proj.weight, last.self_attn.o_proj.weight)]
        pairs += [(getattr(mid.mlp, f"{n}_proj").weight, getattr(last.mlp, f"{n}_proj").weight) for n in ("gate", "up", "down")]
        pairs += [(mid.post_attention_layernorm.weight, last.post_attention_layernorm.weight),
                  (mid.input_layernorm.weight, last.input_layernorm.weight),
                  (mid.hidden_norm.weight, last.input_layernorm.weight)]
        qkv = [(getattr(mid.self_attn, f"{n}_proj").weight, getattr(last.self_attn, f"{n}_proj").weight) for n in "qkv"]
    except AttributeError:
        return False
    if any(a.shape != b.shape for a, b in pairs) or any(a.shape != (b.shape[0], 2 * b.shape[1]) for a, b in qkv):
        return False
    with torch.no_grad():
        for a, b in pairs:
            a.copy_(b.float())
        for a, b in qkv:
            a.copy_(torch.cat([b, b], dim=1).float())
    return True


def ttt_attend(history: list, j: int, scale: float):
    """Attention of unrolled step ``j`` (module docstring): ``history`` collects each step's keys and values."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        history.append((k, v))
        t, heads = q.shape[0], q.shape[1]
        rep = heads // k.shape[1]
        qh = q.transpose(0, 1)  # [H, T, D]
        k0, v0 = (x.repeat_interleave(rep, dim=1).transpose(0, 1) for x in history[0])
        pos = torch.arange(t, device=q.device)
        scores = [(qh @ k0.transpose(1, 2) * scale).masked_fill(pos[None, :] > pos[:, None] - j, float("-inf"))]
        shifted = []
        for i in range(1, j + 1):  # step i's key at position p - j + i: shift its rows by j - i
            ki, vi = (torch.nn.functional.pad(x.repeat_interleave(rep, dim=1).transpose(0, 1), (0, 0, j - i, 0))[:, :t]
                      for x in history[i])
            scores.append(((qh * ki).sum(-1, keepdim=True) * scale))
            shifted.append(vi)
        probs = torch.cat(scores, dim=-1).float().softmax(-1).to(q.dtype)
        out = probs[..., :t] @ v0
        for i, vi in enumerate(shifted):
            out = out + probs[..., t + i : t + i + 1] * vi
        return out.transpose(0, 1)

    return attend


def text_loss(head: EagleHead, model_head: torch.Tensor, rec: train_data.Record, ttt_steps: int) -> tuple[torch.Tensor, float]:
    """The unrolled loss over one text, and the first step's top-1 agreement with the target."""
    tokens, n = rec.tokens, rec.tokens.shape[0]
    if n < 3:
        return torch.zeros((), requires_grad=True), 0.0
    with torch.no_grad():  # soft targets: position p (head) predicts token p + 2, the target's row p + 1
        target = (rec.final[1:].float() @ model_head.T).log_softmax(-1)  # [n - 1, Vd]
    ids, positions = tokens[1:], torch.arange(n - 1)
    hidden = head.fc(rec.aux[:-1].float())
    history: list = []
    total, agree = torch.zeros(()), 0.0
    scale = head.config.head_dim ** -0.5
    for j in range(ttt_steps):
        if j >= n - 1:
            break
        prenorm = head(ids, positions, hidden, ttt_attend(history, j, scale))
        logp = head.logits(prenorm[j:]).log_softmax(-1)
        loss = -(target[j:].exp() * logp).sum(-1).mean()
        total = total + 0.8 ** j * loss
        if j == 0:
            agree = (logp.argmax(-1) == target.argmax(-1)).float().mean().item()
        hidden = torch.nn.functional.pad(prenorm[:-1], (0, 0, 1, 0))  # fed one position on
    return total, agree


def train_eagle(model: torch.nn.Module, tokenizer, out: str, config: TrainConfig, prompts: list | None = None,
                engine_kwargs: dict | None = None, progress: bool = True) -> EagleHead:
    """Train (or resume training) a head for ``model`` and write it to ``out`` (module docstring)."""
    from hf_paged.executor.step_runners import decoder_layers

    os.makedirs(out, exist_ok=True)
    head_cfg = head_config_for(model, config.draft_vocab_size)
    num_layers = len(decoder_layers(model))
    if num_layers < 2:
        raise ValueError("an EAGLE-3 head reads the states between decoder layers: the target needs at least 2 layers")
    # vLLM's default ids (2, L // 2, L - 3), kept inside 1 .. L - 1 for shallow targets
    head_cfg.aux_layer_ids = [min(max(i, 1), num_layers - 1) for i in (2, num_layers // 2, num_layers - 3)]
    layers = aux_layers(head_cfg, num_layers)
    data = _data(model, tokenizer, out, config, prompts, layers, engine_kwargs)
    vocab, records = data["vocab"], data["records"]
    head = init_head(model, head_cfg, vocab, config.seed)
    if config.init_layer and not copy_last_layer(model, head):
        logger.warning("the target's last decoder layer does not fit the head's layer: it starts at random")
    # the target's embedding, frozen: gradients stay in the head (a loaded head shares the target's again)
    head._shared_embedding[0] = torch.nn.Embedding.from_pretrained(
        model.get_input_embeddings().weight.detach().float(), freeze=True)
    head.train()
    model_head = model.get_output_embeddings().weight.detach()[vocab].float()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    state_path = os.path.join(out, "trainer_state.pt")
    step = 0
    if os.path.isfile(state_path):
        state = torch.load(state_path, weights_only=False)
        if state["config"] != asdict(config) | {"max_steps": None}:
            raise ValueError(f"{state_path} is from another configuration ({state['config']}); use another --out")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        logger.info("resuming EAGLE training at step %d", step)
    total = config.epochs * len(records)
    stop = total if config.max_steps is None else min(total, config.max_steps)
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(config.seed)).tolist()
    bar = _bar(progress, total, step)
    try:
        while step < stop:
            lr = config.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + torch.cos(torch.tensor(step / total * 3.14159)).item())
            for group in opt.param_groups:
                group["lr"] = lr
            loss, agree = text_loss(head, model_head, records[order[step % len(records)]], config.ttt_steps)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}", top1=f"{agree:.2f}")
            if step % config.save_every == 0 or step == stop:
                _save_state(state_path, head, opt, step, config)
    finally:
        if bar is not None:
            bar.close()
    head.eval()
    save_head(head, out)
    return head


def _data(model, tokenizer, out, config: TrainConfig, prompts, layers, engine_kwargs) -> dict:
    path = os.path.join(out, "train_data.pt")
    key = {"tokens": config.tokens, "max_tokens": config.max_tokens, "seed": config.seed,
           "draft_vocab_size": config.draft_vocab_size, "layers": list(layers)}
    if config.greedy_first:
        key["greedy_first"] = True
    if os.path.isfile(path):
        data = torch.load(path, weights_only=False)
        if data["key"] == key:
            logger.info("EAGLE training data from %s", path)
            return data
        logger.info("EAGLE training data in %s is for other settings: generating anew", path)
    texts = train_data.generate_texts(model, tokenizer, prompts or train_data.shipped_prompts(), config.tokens,
                                      config.max_tokens, config.seed, engine_kwargs, config.greedy_first)
    vocab = train_data.draft_vocabulary(texts, config.draft_vocab_size, model.get_output_embeddings().weight.shape[0])
    data = {"key": key, "vocab": vocab, "records": train_data.record(model, texts, layers)}
    torch.save(data, path + ".tmp")
    os.replace(path + ".tmp", path)
    return data


def _save_state(path: str, head: EagleHead, opt, step: int, config: TrainConfig) -> None:
    state = {"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
             "config": asdict(config) | {"max_steps": None}}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)  # a run killed mid-write keeps the previous state


def _bar(progress: bool, total: int, done: int):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, desc="train-eagle", unit="text")
