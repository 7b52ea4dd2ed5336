"""The Gradio chat demo (``hf-paged chat``): streaming answers from one shared engine loop, and a live panel.

Every browser tab is a session; all sessions submit to the same :class:`~hf_paged.serving.AsyncPagedEngine`,
so tabs chatting at once share one continuous batch, which the panel shows (running requests, the KV block
pool coloured by request). Needs ``pip install hf-paged[serve]``.
"""

# No ``from __future__ import annotations``: Gradio reads ``request: gr.Request`` annotations as objects.
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Iterator

from hf_paged.sampling_params import SamplingParams
from hf_paged.structured_params import StructuredOutputsParams
from hf_paged.serving.engine_loop import AsyncPagedEngine, EngineClosedError, QueueFullError
from hf_paged.ui.panel import render_panel, take_snapshot

logger = logging.getLogger(__name__)

STOPPED = "[stopped]"
# what the "speculative decoding" box turns on when the engine was started without a speculative_config
DEFAULT_SPECULATION = {"method": "ngram", "num_speculative_tokens": 4}
ERROR_PREFIX = "⚠ "
BASE_CHOICE = "(base model)"  # the adapter drop-down's entry for no adapter


def _gradio():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no calls home
    try:
        import gradio as gr
    except ImportError as e:  # optional dependency
        raise ImportError("the chat demo needs gradio: pip install hf-paged[serve]") from e
    return gr


def build_prompt(tokenizer, system: str, conversation: list[dict]):
    """The model's prompt for a conversation (its chat template; a plain transcript without one)."""
    messages = ([{"role": "system", "content": system}] if system and system.strip() else []) + conversation
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nAssistant:"


class ChatDemo:
    """The chat page and its handlers.

    Args:
        engine: The shared engine loop (the demo does not shut it down).
        title: Page title.
        system_prompt: Initial system prompt ("" for the model's default).
        temperature, top_p, max_tokens: Initial sampling controls.
    """

    def __init__(self, engine: AsyncPagedEngine, *, title: str = "hf_paged chat", system_prompt: str = "",
                 temperature: float = 0.7, top_p: float = 0.9, max_tokens: int = 256) -> None:
        self.engine = engine
        self.title = title
        self.system_prompt = system_prompt
        self.temperature = temperature
        self.top_p = top_p
        self.max_tokens = max_tokens
        self.max_tokens_limit = max(1, min(4096, engine.max_model_len - 1))
        self.engine_speculates = engine.engine.config.speculative_config is not None
        self.live: dict[str, list[str]] = {}  # session -> request ids of its answers being generated
        self.finished: list[tuple[str, str | None]] = []  # (request id, finish reason) of every answer
        self._turns = itertools.count(1)
        self._lock = threading.Lock()
        self._panel: tuple[float, tuple | str | None] = (0.0, None)  # (when, the panel's data or an error page)

    # -- handlers -----------------------------------------------------------------------------------
    def respond(self, message: str, conversation: list[dict], system: str, temperature: float, top_p: float,
                max_tokens: float, session: str, speculative: bool | None = None, json_schema: str = "",
                adapter: str = "") -> Iterator[tuple[list[dict], list[dict], str]]:
        """Stream one answer: yields (chatbot messages, conversation state, message box).

        ``speculative``: draft tokens for this answer (the engine's speculative_config, else n-gram with 4
        drafts), or not; None keeps the engine's setting. Greedy answers are the same either way.
        ``json_schema``: a JSON schema (text) the answer must be valid JSON under; "" for free text. An invalid
        schema is shown as an error in the chat, and nothing is generated. ``adapter``: the name of a loaded LoRA
        adapter to answer with; "" or :data:`BASE_CHOICE`: the base model."""
        if not message or not message.strip():
            yield conversation, conversation, ""
            return
        conversation = [*conversation, {"role": "user", "content": message}]
        shown = [*conversation, {"role": "assistant", "content": ""}]
        yield shown, conversation, ""
        text, reason, error = "", None, None
        try:
            params = SamplingParams(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                                    num_speculative_tokens=0 if speculative is False else None,
                                    structured_outputs=_schema_constraint(json_schema))
            spec = DEFAULT_SPECULATION if speculative and not self.engine_speculates else None
            prompt = build_prompt(self.engine.tokenizer, system, conversation)
            stream = self.engine.add_request(prompt, params, request_id=f"chat-{session[:6]}-{next(self._turns)}",
                                             speculative_config=spec, lora_request=self._adapter(adapter))
        except (ValueError, TypeError, ImportError, QueueFullError, EngineClosedError) as e:
            shown[-1] = {"role": "assistant", "content": f"{ERROR_PREFIX}{e}"}
            yield shown, conversation, ""
            return
        with self._lock:
            self.live.setdefault(session, []).append(stream.request_id)
        yield shown, conversation, ""  # in flight: the page's Stop button is enabled from here on
        try:
            for delta in stream:
                text += delta.text or ""
                if delta.finished:
                    reason = delta.finish_reason
                    error = next((c.error for c in delta.outputs if c.error), None)
                shown[-1] = {"role": "assistant", "content": text}
                yield shown, conversation, ""
        finally:
            with self._lock:
                mine = self.live.get(session, [])
                if stream.request_id in mine:
                    mine.remove(stream.request_id)
                if not mine:
                    self.live.pop(session, None)
                self.finished.append((stream.request_id, reason))
        if reason == "error":
            shown[-1] = {"role": "assistant", "content": f"{text}\n\n{ERROR_PREFIX}engine error: {error}"}
        elif reason == "abort":
            shown[-1] = {"role": "assistant", "content": f"{text} {STOPPED}"}
        conversation = [*conversation, {"role": "assistant", "content": text}]
        yield shown, conversation, ""

    def adapters(self) -> list[str]:
        """The loaded LoRA adapters' names (an engine with ``enable_lora``), for the drop-down."""
        return sorted(r.lora_name for r in self.engine.engine.list_loras())

    def _adapter(self, name: str):
        if not name or name == BASE_CHOICE:
            return None
        found = next((r for r in self.engine.engine.list_loras() if r.lora_name == name), None)
        if found is None:
            raise ValueError(f"the LoRA adapter {name!r} is not loaded (loaded: {self.adapters()})")
        return found

    def stop(self, session: str) -> None:
        """Abort the session's answers in the engine (their blocks are freed before the next step)."""
        with self._lock:
            rids = list(self.live.get(session, ()))
        for rid in rids:
            self.engine.abort(rid)

    def generating(self, session: str) -> bool:
        """Whether the session has an answer in flight (its Stop button is enabled only then)."""
        with self._lock:
            return bool(self.live.get(session))

    def panel(self, session: str | None = None) -> str:
        """The live panel's HTML as ``session``'s tab sees it: its own requests are marked "you".

        One engine snapshot per half second, whichever tab asks; each tab renders it with its own requests."""
        with self._lock:
            taken, data = self._panel
        if time.time() - taken >= 0.5 or data is None:
            try:
                snap = self.engine.call(take_snapshot).result(timeout=10)
                data = (snap, self.engine.generation_throughput(), self.engine.num_waiting,
                        dict(self.engine.num_finished_by_reason))
            except EngineClosedError:
                data = "<div class='hfp-panel'>engine stopped</div>"
            except Exception as e:  # noqa: BLE001 - the panel never breaks the page
                logger.exception("panel snapshot failed")
                return f"<div class='hfp-panel'>panel unavailable: {type(e).__name__}: {e}</div>"
            with self._lock:
                self._panel = (time.time(), data)
        if isinstance(data, str):
            return data
        with self._lock:
            mine = set(self.live.get(session, ())) if session is not None else set()
        return render_panel(*data, mine=mine)

    # -- the page -----------------------------------------------------------------------------------
    def build(self):
        """The ``gr.Blocks`` page."""
        gr = _gradio()

        def respond(message, conversation, system, temperature, top_p, max_tokens, speculative, json_schema,
                    adapter, request: gr.Request):
            session, shown = _session(request), None
            for out in self.respond(message, conversation, system, temperature, top_p, max_tokens, session,
                                    bool(speculative), json_schema or "", adapter or ""):
                active = self.generating(session)  # Stop: enabled while this tab has an answer in flight
                yield (*out, gr.update(interactive=active) if active != shown else gr.skip())
                shown = active

        def stop(request: gr.Request):
            self.stop(_session(request))

        def stop_state(request: gr.Request):  # after an answer, however it ended
            return gr.update(interactive=self.generating(_session(request)))

        def panel_html(request: gr.Request):
            return self.panel(_session(request))

        def clear(request: gr.Request):
            self.stop(_session(request))
            return [], []

        with gr.Blocks(title=self.title) as demo:
            conversation = gr.State([])
            gr.Markdown(f"## {self.title}\nStreaming answers from one shared paged-KV engine: tabs chatting at "
                        "once run in one continuous batch (see the panel).")
            with gr.Row():
                with gr.Column(scale=3):
                    chatbot = gr.Chatbot(elem_id="hfp-chatbot", height=460, label="chat")
                    message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False,
                                         elem_id="hfp-message", lines=1)
                    with gr.Row():
                        send = gr.Button("Send", variant="primary", elem_id="hfp-send")
                        stop_button = gr.Button("Stop", variant="stop", elem_id="hfp-stop", interactive=False)
                        clear_button = gr.Button("Clear", elem_id="hfp-clear")
                    system = gr.Textbox(self.system_prompt, label="System prompt", lines=2, elem_id="hfp-system")
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, self.temperature, step=0.05, label="Temperature",
                                                elem_id="hfp-temperature")
                        top_p = gr.Slider(0.05, 1.0, self.top_p, step=0.05, label="Top-p", elem_id="hfp-top-p")
                        max_tokens = gr.Slider(1, self.max_tokens_limit, min(self.max_tokens, self.max_tokens_limit),
                                               step=1, label="Max tokens", elem_id="hfp-max-tokens")
                    speculative = gr.Checkbox(self.engine_speculates, elem_id="hfp-speculative",
                                              label="Speculative decoding (drafts verified by the model; "
                                                    "same greedy answers, faster on repetitive text)")
                    json_schema = gr.Textbox("", lines=3, elem_id="hfp-json-schema",
                                             label="JSON schema (optional: answers are JSON valid under it)",
                                             placeholder='{"type": "object", "properties": {"name": {"type": '
                                                         '"string"}}, "required": ["name"]}')
                    # the loaded LoRA adapters (an engine with enable_lora; hidden otherwise)
                    adapter = gr.Dropdown([BASE_CHOICE, *self.adapters()], value=BASE_CHOICE, elem_id="hfp-adapter",
                                          label="LoRA adapter", visible=self.engine.engine.config.enable_lora)
                with gr.Column(scale=2):
                    panel = gr.HTML(self.panel(), elem_id="hfp-panel", label="engine")
            inputs = [message, conversation, system, temperature, top_p, max_tokens, speculative, json_schema, adapter]
            outputs = [chatbot, conversation, message, stop_button]
            for trigger in (message.submit, send.click):
                trigger(respond, inputs, outputs, concurrency_limit=None, show_progress="hidden").then(
                    stop_state, None, stop_button, queue=False, show_progress="hidden")
            stop_button.click(stop, None, None, concurrency_limit=None, queue=False)
            clear_button.click(clear, None, [chatbot, conversation], concurrency_limit=None, queue=False)
            timer = gr.Timer(1.0)
            timer.tick(panel_html, None, panel, concurrency_limit=None, show_progress="hidden")
        return demo

    def launch(self, host: str = "127.0.0.1", port: int = 7860, **kw):
        """Serve the page (never shared publicly); returns Gradio's ``(app, local_url, share_url)``."""
        gr = _gradio()
        demo = self.build()
        demo.queue(default_concurrency_limit=None)
        theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                                  font_mono=["ui-monospace", "monospace"])  # local fonts: works offline
        self.demo = demo
        return demo.launch(server_name=host, server_port=port, share=False, ssr_mode=False, theme=theme,
                           footer_links=[], **kw)


def _schema_constraint(text: str) -> StructuredOutputsParams | None:
    """The settings' "JSON schema" box as a structured-output constraint (None when empty)."""
    if not text or not text.strip():
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema box is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"the JSON schema box must hold a JSON object (a schema), got {text.strip()[:60]!r}")
    return StructuredOutputsParams(json=schema)


def _session(request) -> str:
    return (getattr(request, "session_hash", None) or "anon") if request is not None else "anon"
