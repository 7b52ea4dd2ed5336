"""``PagedGenerator``'s structured-output intake: each request's grammar compiled (cached, under the compile
budget) on the thread that adds it, and the compile worker's lifetime."""

from __future__ import annotations

import threading


class StructuredIntake:
    """The grammar side of :class:`~hf_paged.PagedGenerator` (its ``_grammars`` cache, built on first use)."""

    def prepare_structured(self, params, cancel: threading.Event | None = None, cached_only: bool = False):
        """``params`` (SamplingParams or BeamSearchParams) with its structured-output grammar compiled (once per
        distinct spec), on this thread, within ``structured_compile_timeout_s`` (ValueError past it).

        Args:
            cancel: Set it from another thread to stop a compile that is no longer wanted (its caller then
                gets :class:`~hf_paged.structured.compile_worker.CompileCancelled`).
            cached_only: Compile nothing: set the grammar only if it is cached, else return ``params`` as
                they are (the server looks up on its request threads and compiles on its compile thread).
        """
        from hf_paged.structured.compiler import prepare_params

        return prepare_params(self._grammar_cache(), params, cancel, cached_only)

    def warm_structured(self) -> bool:
        """Build the structured-output compiler and start its compile worker process now, in the background,
        so that the first structured request does not wait seconds for it (``hf-paged serve`` and ``chat`` call
        this at start). False where structured output is unavailable (no tokenizer, no xgrammar)."""
        if self.tokenizer is None:
            return False
        try:
            self._grammar_cache().warm()
        except (ImportError, ValueError):
            return False
        return True

    def _grammar_cache(self):
        from hf_paged.structured.compiler import GrammarCompilerCache

        if self.tokenizer is None:
            raise ValueError("structured_outputs need the engine's tokenizer: pass tokenizer= to the engine")
        self._check_usable()  # a closed engine starts no compile worker
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompilerCache(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                                      compile_timeout_s=self.config.structured_compile_timeout_s)
            return self._grammars

    def _close_grammars(self) -> None:
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()  # its compile worker's child process
