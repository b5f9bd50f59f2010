"""Prompts longer than a CLIP text encoder reads at once (77 tokens), embedded in chunks.

A1111's and ComfyUI's way, which users of long prompts expect: the text is cut
into chunks of at most 75 tokens (at sentence, then word boundaries), each
encoded with its own start and end token, and the chunks' embeddings are
concatenated; the UNet's cross-attention reads any length.  SD 1.x/2.x use the
text encoder's last hidden states; SDXL the penultimate ones of both encoders,
side by side, and the pooled embedding of the second.  The chunking is compel's
(``EmbeddingsProvider``, a maintained library), called with each text as one
fragment of weight 1: compel's prompt syntax (``(word)1.2``, ``word++``) is never
parsed, so a prompt means what it says.

Only prompts (or negative prompts) over the limit take this path: every other
prompt goes to the pipeline as text, exactly as before, so its image keeps its
bytes.  A prompt and its negative are padded with the empty prompt's embedding to
the same number of chunks; prompts of one chunk count share a pipeline call.

Truncation (``long_prompts=truncate``, or a pipeline this module cannot chunk
for) is the pipeline's own; its warning, which quotes every token it cuts
(about 60 kB per batch for long prompts), becomes one line per worker
(:class:`TruncationNotice`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from renderfleet.spec import Prompt

log = logging.getLogger(__name__)

# What diffusers' SD and SDXL pipelines log for each prompt they cut.
_TRUNCATED = "The following part of your input was truncated"


class TruncationNotice(logging.Filter):
    """Lets the first "input was truncated" warning through, shortened to one line, and drops the rest.

    For a T5 family (``t5_tokens``: its sequence length) the CLIP half's notices are dropped
    altogether (CLIP reading 77 tokens is the family's design, not a loss: T5 reads the prompt on),
    and the first notice of T5 itself cutting a prompt is said once."""

    def __init__(self, t5_tokens: int = 0) -> None:
        super().__init__()
        self.said = False
        self.t5_tokens = t5_tokens

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(_TRUNCATED):
            return True
        if self.t5_tokens and "max_sequence_length" not in message:
            return False  # the CLIP encoder's 77: by design
        if self.said:
            return False
        self.said = True
        record.msg = (
            f"prompts over the T5 encoder's {self.t5_tokens} tokens are cut at {self.t5_tokens}; said once per worker"
            if self.t5_tokens
            else "prompts over the text encoder's 77 tokens are cut at 77 (long_prompts=truncate, or a pipeline "
            "without chunking); said once per worker"
        )
        record.args = ()
        return True


_NOTICE = TruncationNotice()


def quiet_truncation(pipe: Any, t5_tokens: int = 0) -> None:
    """Install :data:`_NOTICE` (a T5 family's own notice: ``t5_tokens``) on the logger of ``pipe``'s
    pipeline module (once; at load, never at import)."""
    logger = logging.getLogger(type(pipe).__module__)
    if t5_tokens:
        if not any(isinstance(f, TruncationNotice) for f in logger.filters):
            logger.addFilter(TruncationNotice(t5_tokens))
    elif _NOTICE not in logger.filters:
        logger.addFilter(_NOTICE)


@dataclass
class Embedded:
    """A long prompt's conditioning: its and its negative's embeddings, ``chunks`` x 77 tokens each."""

    chunks: int
    prompt: Any
    negative: Any
    pooled: Any = None  # SDXL
    negative_pooled: Any = None


class LongPrompts:
    """Chunked embeddings of a pipeline's long prompts (see the module docstring)."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.tokenizer: Any = getattr(pipe, "tokenizer", None)
        self.sdxl = getattr(pipe, "text_encoder_2", None) is not None and getattr(pipe, "tokenizer_2", None) is not None
        # SD 1.x/2.x and SDXL: a CLIP tokenizer and encoder (and SDXL's second pair); not SD3 or Flux (T5).
        self.supported = (
            self.tokenizer is not None
            and getattr(pipe, "text_encoder", None) is not None
            and getattr(pipe, "text_encoder_3", None) is None
            and hasattr(pipe, "unet")
        )
        self._provider: Any = None
        self._empty: Any = None
        self._warned = False
        quiet_truncation(pipe)

    @property
    def limit(self) -> int:
        """Tokens per chunk, the start and end tokens included (77 for CLIP)."""
        return int(getattr(self.tokenizer, "model_max_length", 77))

    def tokens(self, text: str) -> int:
        """How many tokens ``text`` is, with its start and end tokens."""
        return len(self.tokenizer(text, truncation=False, add_special_tokens=True, verbose=False).input_ids)

    def is_long(self, text: str) -> bool:
        return self.tokenizer is not None and self.tokens(text) > self.limit

    def embed(self, prompts: Any) -> list[Embedded | None] | None:
        """Each prompt's chunked conditioning, None for one within the limit (it goes as text);
        None when no prompt needs chunks (or this pipeline cannot chunk: then the pipeline cuts)."""
        wanted = [p.long_prompts == "chunk" and (self.is_long(p.prompt) or self.is_long(p.negative_prompt)) for p in prompts]
        if not any(wanted):
            return None
        if not self.supported:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s cannot embed prompts in chunks; prompts over %d tokens are cut", type(self.pipe).__name__, self.limit
                )
            return None
        import torch

        with torch.inference_mode():
            return [self._embed(p) if want else None for p, want in zip(prompts, wanted, strict=True)]

    def call_kwargs(self, embeds: list[Embedded]) -> dict[str, Any]:
        """The pipeline's arguments for prompts of one chunk count, in place of their text."""
        import torch

        kwargs = {
            "prompt_embeds": torch.cat([e.prompt for e in embeds]),
            "negative_prompt_embeds": torch.cat([e.negative for e in embeds]),
        }
        if self.sdxl:
            kwargs["pooled_prompt_embeds"] = torch.cat([e.pooled for e in embeds])
            kwargs["negative_pooled_prompt_embeds"] = torch.cat([e.negative_pooled for e in embeds])
        return kwargs

    # ---- compel ------------------------------------------------------------------------

    def provider(self) -> Any:
        """compel's embeddings provider for this pipeline's encoder(s), built at the first long prompt."""
        if self._provider is None:
            from compel.embeddings_provider import EmbeddingsProvider, EmbeddingsProviderMulti, ReturnedEmbeddingsType

            pipe = self.pipe
            device = str(pipe.text_encoder.device)
            if self.sdxl:
                self._provider = EmbeddingsProviderMulti(
                    [pipe.tokenizer, pipe.tokenizer_2],
                    [pipe.text_encoder, pipe.text_encoder_2],
                    truncate=False,
                    returned_embeddings_type=ReturnedEmbeddingsType.PENULTIMATE_HIDDEN_STATES_NON_NORMALIZED,
                    requires_pooled_mask=[False, True],
                )
                for one in self._provider.embedding_providers:
                    one.device = device
            else:
                self._provider = EmbeddingsProvider(
                    pipe.tokenizer,
                    pipe.text_encoder,
                    truncate=False,
                    device=device,
                    returned_embeddings_type=ReturnedEmbeddingsType.LAST_HIDDEN_STATES_NORMALIZED,
                )
        return self._provider

    def _encode(self, text: str) -> Any:
        device = str(self.pipe.text_encoder.device)
        return self.provider().get_embeddings_for_weighted_prompt_fragments([[text]], [[1.0]], device=device)

    def _pad(self, embedding: Any, chunks: int) -> Any:
        """``embedding`` padded with the empty prompt's chunk to ``chunks`` x 77 tokens."""
        import torch

        missing = chunks - embedding.shape[1] // self.limit
        if missing <= 0:
            return embedding
        if self._empty is None:
            self._empty = self._encode("")
        return torch.cat([embedding, *([self._empty] * missing)], dim=1)

    def _embed(self, p: Prompt) -> Embedded:
        import torch

        cond, neg = self._encode(p.prompt), self._encode(p.negative_prompt)
        chunks = max(cond.shape[1], neg.shape[1]) // self.limit
        cond, neg = self._pad(cond, chunks), self._pad(neg, chunks)
        if not self.sdxl:
            return Embedded(chunks, cond, neg)
        device = str(self.pipe.text_encoder.device)
        pooled = self.provider().get_pooled_embeddings([p.prompt], device=device)
        neg_pooled = self.provider().get_pooled_embeddings([p.negative_prompt], device=device)
        if p.negative_prompt == "" and getattr(self.pipe.config, "force_zeros_for_empty_prompt", False):
            # what the SDXL pipeline does with an empty negative prompt
            neg, neg_pooled = torch.zeros_like(neg), torch.zeros_like(neg_pooled)
        return Embedded(chunks, cond, neg, pooled, neg_pooled)
