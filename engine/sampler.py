"""Turn the last-position logits of each sequence into tokens.

Order of operations (vLLM's): allowed_token_ids and logit_bias → penalties → min_tokens masking
→ greedy argmax, or temperature → top-k → top-p → min-p → sample. Logprobs are those of the raw
model distribution.

Sampling uses the exponential-race form of the Gumbel-max trick: `argmax(p / q)` with
`q ~ Exp(1)` draws from `p`. For a request with a `seed`, `q` comes from a generator seeded with
`H(seed, position)`, so its randomness depends only on (seed, position) — never on which
other requests share the batch, nor on which instance (colocated, prefill or decode) samples it.
"""

from __future__ import annotations

import hashlib

import torch

from splitserve.engine.request import Logprob, Request, TokenLogprobs


def position_seed(seed: int, position: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)  # stream of unseeded requests

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]
                 ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits [S, vocab] fp32 (one row per request, in order) → token ids, logprobs."""
        logits = logits[:, : self.vocab_size].float().cpu()
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits.contiguous(), requests)  # a fresh tensor: edit it
        tokens = self._sample(logits, requests)
        logprobs = [self._logprobs(raw_logprobs, i, t, r) for i, (t, r)
                    in enumerate(zip(tokens, requests, strict=True))]
        return tokens, logprobs

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        for i, request in enumerate(requests):
            params = request.sampling_params
            if params.allowed_token_ids is not None or params.logit_bias:
                _bias_row(logits[i], params.allowed_token_ids, params.logit_bias)
            if params.needs_penalties:
                self._penalize_row(logits[i], request)
            if request.num_output_tokens < params.min_tokens:
                banned = list(request.eos_token_ids) + list(params.stop_token_ids)
                logits[i, [t for t in banned if t < self.vocab_size]] = float("-inf")
        return logits

    def _penalize_row(self, row: torch.Tensor, request: Request) -> None:
        """Repetition: every token seen (prompt and output); presence/frequency: output only.

        Output includes prior output (a decode instance's t0), so both match a colocated run."""
        params = request.sampling_params
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                    vals * params.repetition_penalty)
        if request.output_token_ids and (params.frequency_penalty or params.presence_penalty):
            out = torch.tensor(request.output_token_ids, dtype=torch.long)
            counts = torch.bincount(out, minlength=self.vocab_size)[: self.vocab_size].float()
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        # numpy's argmax is ~10x faster than torch's on CPU; both return the first maximum.
        tokens = logits.numpy().argmax(axis=-1).tolist()
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if not rows:
            return tokens
        sub = logits[rows]
        temps = torch.tensor([requests[i].sampling_params.temperature for i in rows])
        sub = _filter_top_k_top_p(sub / temps[:, None], [requests[i] for i in rows])
        probs = torch.softmax(sub, dim=-1)
        noise = torch.stack([self._noise(requests[i]) for i in rows])
        for i, token in zip(rows, (probs / noise).numpy().argmax(axis=-1).tolist(), strict=True):
            tokens[i] = token
        return tokens

    def _noise(self, request: Request) -> torch.Tensor:
        seed = request.sampling_params.seed
        generator = self.generator
        if seed is not None:
            # The absolute position of the token being sampled: a decode instance that received
            # t0 inside its prompt samples t1 at the same position as a colocated instance.
            generator = torch.Generator().manual_seed(position_seed(seed, request.num_tokens))
        return torch.empty(self.vocab_size).exponential_(generator=generator)

    def _logprobs(self, raw: torch.Tensor | None, i: int, token: int,
                  request: Request) -> TokenLogprobs | None:
        k = request.sampling_params.logprobs
        if raw is None or k is None:
            return None
        top = []
        if k > 0:
            values, ids = raw[i].topk(k)
            top = [Logprob(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True)]
        return TokenLogprobs(Logprob(token, float(raw[i, token])), top)


def _bias_row(row: torch.Tensor, allowed: list[int] | None,
              bias: dict[int, float] | None) -> None:
    """Everything outside `allowed` to -inf, then `bias` added (OpenAI's logit_bias: -100 all
    but bans a token, +100 all but forces it). Ids were checked against the vocabulary."""
    if allowed is not None:
        keep = torch.tensor(allowed, dtype=torch.long)
        kept = row[keep]
        row.fill_(float("-inf"))
        row[keep] = kept
    if bias:
        ids = torch.tensor(list(bias), dtype=torch.long)
        row[ids] += torch.tensor(list(bias.values()), dtype=row.dtype)


def _filter_top_k_top_p(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Mask to -inf what top-k, top-p and min-p exclude; logits [R, vocab] already tempered."""
    params = [r.sampling_params for r in requests]
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    min_p = torch.tensor([p.min_p for p in params])
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab)[None, :]
        drop = ranks >= top_k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop |= (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[:, None]
        drop[:, 0] = False
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if (min_p > 0).any():
        probs = torch.softmax(logits, dim=-1)
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
