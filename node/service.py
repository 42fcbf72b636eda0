"""One served model: its loaded weights, runner and scheduler, and turning API requests into jobs.

Rendering and tokenizing grow with a request's size, so the HTTP layer runs them off the event loop; before
either, a prompt whose text alone cannot fit the context is refused: no token of this tokenizer stands for
more than `LoadedModel.max_token_bytes` bytes, so B bytes of text are at least B / max_token_bytes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache.arena import Scope
from cache.prefix_cache import PrefixCache
from cache.snapshot_policy import SnapshotPolicy
from node.config import Limits
from node.engine.chat_template import ChatTemplateError, RenderedChat, render_chat
from node.engine.loader import LoadedModel
from node.engine.runner import GenerationRequest, Runner
from node.engine.sampling import SamplingParams
from node.engine.scheduler import Scheduler
from node.errors import invalid_request
from node.openai_schema import CommonParams, Message


@dataclass(frozen=True, slots=True)
class ModelService:
    loaded: LoadedModel
    runner: Runner
    scheduler: Scheduler

    @classmethod
    def create(cls, loaded: LoadedModel, prefix_cache: PrefixCache | None, max_queue: int,
               policy: SnapshotPolicy | None = None) -> ModelService:
        runner = Runner(loaded, prefix_cache, policy=policy)
        return cls(loaded, runner, Scheduler(runner, max_queue))

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def vocab_size(self) -> int:
        return int(self.loaded.model.config.get_text_config(decoder=True).vocab_size)

    def check_text_fits(self, text_bytes: int, param: str) -> None:
        """Refuse, before rendering or tokenizing, text too long for the context whatever its tokens."""
        per_token = self.loaded.max_token_bytes
        least = -(-text_bytes // per_token)
        if least >= self.loaded.context_length:
            raise invalid_request(f"the prompt's text is {text_bytes} bytes, at least {least} tokens (no token of "
                                  f"this model is more than {per_token} bytes); this model's context length is "
                                  f"{self.loaded.context_length} tokens", param=param, code="context_length_exceeded")

    def chat_prompt(self, messages: tuple[Message, ...]) -> RenderedChat:
        self.check_text_fits(sum(len(m.content.encode("utf-8", "surrogatepass")) for m in messages), "messages")
        try:
            return render_chat(self.loaded.tokenizer, [{"role": m.role, "content": m.content} for m in messages],
                               fits=self.loaded.context_length - 1)
        except ChatTemplateError as exc:
            raise invalid_request(f"model {self.model_id!r}: {exc}", param="messages") from exc

    def text_prompt(self, prompt: str | tuple[int, ...]) -> RenderedChat:
        """A text completion prompt: no message structure, so no boundaries. Token ids are checked only when
        they can fit the context (`request` refuses the others), so the check is bounded by the context."""
        if isinstance(prompt, str):
            self.check_text_fits(len(prompt.encode("utf-8", "surrogatepass")), "prompt")
            return RenderedChat(list(self.loaded.tokenizer(prompt, add_special_tokens=True)["input_ids"]), ())
        vocab = self.vocab_size
        if prompt and len(prompt) < self.loaded.context_length and (min(prompt) < 0 or max(prompt) >= vocab):
            bad = next(i for i, t in enumerate(prompt) if not 0 <= t < vocab)
            raise invalid_request(f"prompt[{bad}] is not a token id of this model (0 to {vocab - 1})",
                                  param="prompt")
        return RenderedChat(list(prompt), ())

    def request(self, caller: str, rendered: RenderedChat, params: CommonParams, limits: Limits,
                prompt_param: str, retain: bool = True) -> GenerationRequest:
        """Check the prompt against the context length and build the engine request."""
        prompt = rendered.ids
        context = self.loaded.context_length
        if not prompt:
            raise invalid_request("the prompt is empty", param=prompt_param)
        if len(prompt) >= context:
            raise invalid_request(f"the prompt is {len(prompt)} tokens; this model's context length is "
                                  f"{context} tokens, which must also fit at least one output token",
                                  param=prompt_param, code="context_length_exceeded")
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = min(limits.default_max_tokens, context - len(prompt))
        elif len(prompt) + max_tokens > context:
            raise invalid_request(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds "
                                  f"this model's context length of {context} tokens; lower max_tokens",
                                  param="max_tokens", code="context_length_exceeded")
        vocab = self.vocab_size
        if any(token >= vocab for token, _ in params.logit_bias):
            raise invalid_request(f"'logit_bias' keys must be token ids of this model (0 to {vocab - 1})",
                                  param="logit_bias")
        sampling = SamplingParams(max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
                                  seed=params.seed, stop=params.stop, presence_penalty=params.presence_penalty,
                                  frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias)
        return GenerationRequest(scope=Scope(caller=caller, model=self.model_id), prompt=prompt, params=sampling,
                                 boundaries=rendered.boundaries, retain=retain and params.retain)
