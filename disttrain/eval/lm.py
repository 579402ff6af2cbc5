"""lm-evaluation-harness's model interface over a run's model as it is laid out over the ranks.

``ShardedLM`` is the harness's own Hugging Face model class (``HFLM``: its tokenisation, batching, truncation and
scoring, as its ``hf`` model scores an exported folder) with two differences:

- the logits come from the run's forward (``forward``: the task as wrapped by DDP, FSDP2 or tensor parallelism),
  and generation is greedy through that forward, one document at a time (no key/value cache, no padding);
- every rank is handed every request, scores its data-parallel share and receives the others' results.

The harness can split documents over ranks itself (``LM.rank``/``world_size``), but it draws each rank's few-shot
examples from its own sampler in turn, so a document's prompt would depend on the number of ranks, and its padding
counts requests, not forwards. Here each rank builds every request as one process would (the harness sees one
rank), so prompts are those of a single-process evaluation, and the split is this class's: the requests of one
kind are cut into equal shares of the data-parallel ranks (the last repeated to pad), each share scored, and the
results gathered on every rank. Ranks that share a model (FSDP2 shards, tensor-parallel peers) must run as many
forwards as each other, whatever their shares hold: each forward is preceded by a one-number all-reduce saying
whether any rank still has one to run, and a rank whose share is done runs one-token forwards beside the others'
until none has (as ``generate(synced_gpus=True)`` does in ``transformers``), so the collectives inside the forwards
pair up across ranks. The ranks of a tensor-parallel group score the same share with the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lm_eval.models.huggingface import HFLM

from disttrain.errors import ConfigError


class ShardedLM(HFLM):
    """The harness's ``HFLM`` whose forward is the run's, its requests split over the data-parallel ranks."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], hf_model: Any, tokenizer: Any,
                 batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> None:
        """``forward``: token ids ``[B, T]`` to logits ``[B, T, vocab]`` on every rank of the run; ``hf_model``: the
        ``transformers`` model whose config (length, end-of-text id) the harness reads; ``dp_rank``/``dp_size``:
        this rank's share of the requests."""
        super().__init__(pretrained=hf_model, tokenizer=tokenizer, batch_size=batch_size)
        self.forward = forward
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.synced = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        """Other ranks run forwards alongside (each forward is agreed on first)."""
        generation = getattr(hf_model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        self.stop_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        """Token ids that end a generation, as ``generate()`` ends it (the model's generation config)."""

    def _model_call(self, inps: torch.Tensor, attn_mask: torch.Tensor | None = None,
                    labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of the run's forward, once every rank has agreed to run one."""
        self._any_rank_runs(True)
        with torch.no_grad():
            return self.forward(inps)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **kwargs: Any) -> torch.Tensor:
        """Greedy continuations of the left-padded ``context`` rows up to ``max_length`` tokens in all, each row on
        its own (the run's forward takes no attention mask) and padded on the right, as ``generate()`` returns
        them."""
        if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) not in (0, 0.0, None):
            raise ConfigError("eval.tasks", kwargs, "tasks that generate greedily (do_sample false, temperature 0)")
        mask = kwargs.get("attention_mask")
        rows = context.new_full((context.size(0), max_length), self.tokenizer.pad_token_id)
        rows[:, :context.size(1)] = context
        for row, ids in enumerate(context):
            prompt = ids if mask is None else ids[mask[row].bool()]
            new = self._greedy(prompt.tolist(), max_length - context.size(1), stop)
            rows[row, context.size(1):context.size(1) + len(new)] = torch.tensor(new, dtype=rows.dtype)
        return rows

    def _greedy(self, prompt: list[int], max_new: int, stop: list[str]) -> list[int]:
        """Up to ``max_new`` most likely next tokens after ``prompt``, ending at an end-of-text token or once the
        decoded continuation holds a stop sequence (what ``generate()``'s criteria stop at)."""
        tokens, new = list(prompt), []
        for _ in range(max_new):
            logits = self._model_call(torch.tensor([tokens[-self.max_length:]], device=self.device))
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            new.append(token)
            if token in self.stop_ids or any(s in self.tok_decode(new, skip_special_tokens=False) for s in stop):
                break
        return new

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        """The harness's log-likelihoods of this rank's share, gathered with the other ranks'."""
        return self._split(requests, super().loglikelihood)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        """The harness's rolling log-likelihoods of this rank's share, gathered with the other ranks'."""
        return self._split(requests, super().loglikelihood_rolling)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[Any]:
        """The harness's greedy generations of this rank's share, gathered with the other ranks'."""
        return self._split(requests, super().generate_until)

    def _split(self, requests: list[Any], score: Callable[..., list[Any]]) -> list[Any]:
        """``score`` this rank's contiguous share of ``requests`` (padded to equal shares with the last request),
        even out the forwards, and return every rank's results in the requests' order."""
        if not requests or self.dp_size == 1:
            results = score(requests, disable_tqdm=True) if requests else []
            self._run_the_others_forwards()
            return results
        share = -(-len(requests) // self.dp_size)
        padded = requests + [requests[-1]] * (share * self.dp_size - len(requests))
        mine = score(padded[self.dp_rank * share:(self.dp_rank + 1) * share], disable_tqdm=True)
        self._run_the_others_forwards()
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.dp_rank, mine))
        by_rank = {}
        for rank, results in gathered:  # tensor-parallel peers return the same share: the first is kept
            by_rank.setdefault(rank, results)
        return [result for rank in range(self.dp_size) for result in by_rank[rank]][:len(requests)]

    def _any_rank_runs(self, runs: bool) -> bool:
        """Whether this rank (``runs``) or any other is about to run a forward (every rank calls this alike)."""
        if not self.synced:
            return runs
        flag = torch.tensor([int(runs)], dtype=torch.long, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag)

    def _run_the_others_forwards(self) -> None:
        """With this rank's share done: a one-token forward beside each forward another rank still runs, until
        none does."""
        token = torch.tensor([[self.prefix_token_id]], device=self.device)
        while self._any_rank_runs(False):
            with torch.no_grad():
                self.forward(token)


def hf_model_of(net: torch.nn.Module) -> Any:
    """The ``transformers`` model inside a run's network (``model=hf``), under DDP's wrapper where there is one."""
    inner = getattr(net, "module", net)
    return inner._model


def load_tokenizer(folder: str, hf_config: Any) -> Any:
    """The ``transformers`` tokenizer of a run's ``data.tokenizer`` folder, as ``AutoTokenizer`` loads it from the
    run's exported folder (its class from ``tokenizer_config.json``, else from the model's config)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(folder, config=hf_config, local_files_only=True)
