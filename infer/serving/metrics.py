"""The server's Prometheus metrics (`GET /metrics`, the text format, through prometheus_client):
names after vLLM's (`vllm:` -> `dflash:`) so that dashboards built for it read these. One
registry per engine (tests build several servers in one process).

Requests: `num_requests_running`, `num_requests_waiting` (gauges), `request_success_total` by
`finished_reason` (stop, length: answers completed), `request_failure_total` by `reason`
(cancelled, error), `prompt_tokens_total`, `generation_tokens_total` (tokens generated, counted
as each chunk delivers them), histograms `time_to_first_token_seconds`,
`inter_token_latency_seconds` (between a request's successive deliveries of new tokens: one per
chunk that gave it any, as vLLM's per step), `e2e_request_latency_seconds`,
`request_queue_time_seconds`. Speculative decoding: `spec_decode_num_drafts_total` (drafted
steps of a row), `spec_decode_num_draft_tokens_total`, `spec_decode_num_accepted_tokens_total`,
`spec_decode_num_accepted_tokens_per_pos_total` by `position` (1 = the first drafted token),
`spec_decode_steps_total` by step `kind` (`settings.kind_label` of the kind chosen: "1" a
plain step, "8" a block of 8, "-8" a copied block), and `spec_decode_proposer_steps_total`,
`spec_decode_proposer_tokens_total` by `proposer` (`decoding.proposers.NAMES`: text_copy,
corpus_copy, drafted, tree, plain): row-steps and the tokens they committed."""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dflash_jax.decoding import proposers
from dflash_jax.decoding.settings import kind_label

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Buckets as vLLM's: latencies from milliseconds (a chunk) to minutes (a long answer).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics:
    """The engine's counters, gauges and histograms, in their own registry."""

    def __init__(self, model: str = ""):
        self.registry = r = CollectorRegistry(auto_describe=True)
        lab = ("model_name",)
        self.model = model

        def metric(kind, name, doc, labels=(), **kw):
            return kind(f"dflash:{name}", doc, lab + tuple(labels), registry=r, **kw)

        self.running = metric(Gauge, "num_requests_running", "Requests holding a slot.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting for a slot.")
        self.success = metric(
            Counter, "request_success", "Completed requests by finish reason (stop, length).",
            ("finished_reason",),
        )  # fmt: skip
        self.failure = metric(
            Counter, "request_failure", "Requests ended without an answer (cancelled, error).",
            ("reason",),
        )  # fmt: skip
        self.rejected = metric(Counter, "request_rejected", "Requests refused (429: queue full).")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = metric(
            Counter, "generation_tokens", "Tokens generated, counted as each chunk delivers them."
        )
        self.ttft = metric(
            Histogram, "time_to_first_token_seconds", "Arrival to the first token.",
            buckets=TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = metric(
            Histogram, "inter_token_latency_seconds",
            "Between a request's successive deliveries of new tokens.", buckets=ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = metric(
            Histogram, "e2e_request_latency_seconds", "Arrival to the last token.",
            buckets=REQUEST_BUCKETS,
        )  # fmt: skip
        self.queue_time = metric(
            Histogram, "request_queue_time_seconds", "Arrival to admission into a slot.",
            buckets=REQUEST_BUCKETS,
        )  # fmt: skip
        self.drafts = metric(Counter, "spec_decode_num_drafts", "Drafted steps of a row.")
        self.draft_tokens = metric(
            Counter, "spec_decode_num_draft_tokens", "Tokens drafted (or copied) for verify."
        )
        self.accepted = metric(
            Counter, "spec_decode_num_accepted_tokens", "Drafted tokens the target accepted."
        )
        self.accepted_per_pos = metric(
            Counter, "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each position of the block (1 = the first).",
            ("position",),
        )  # fmt: skip
        self.steps = metric(
            Counter, "spec_decode_steps", "Loop steps by kind (1 = a plain target step).",
            ("kind",),
        )  # fmt: skip

        self.proposer_steps = metric(
            Counter, "spec_decode_proposer_steps",
            "Row-steps by proposer (text_copy, corpus_copy, drafted, tree, plain).",
            ("proposer",),
        )  # fmt: skip
        self.proposer_tokens = metric(
            Counter, "spec_decode_proposer_tokens",
            "Tokens committed by the row-steps of each proposer (the bonus token included).",
            ("proposer",),
        )  # fmt: skip

    def of(self, metric, **labels):
        return metric.labels(model_name=self.model, **labels)

    def record_steps(self, acc: np.ndarray, kinds: np.ndarray) -> None:
        """One chunk's records: acc [N, steps] tokens each row committed, kinds [N, steps] the
        step's kind per row (0 where the row ran no step)."""
        for j in range(kinds.shape[1]):
            col = kinds[:, j]
            if col.any():
                kind = proposers.chosen_kind(col[col != 0][0])
                self.of(self.steps, kind=kind_label(kind)).inc()
        steps, tokens = proposers.by_proposer(kinds, acc)
        for name in proposers.NAMES:
            self.of(self.proposer_steps, proposer=name).inc(steps[name])
            self.of(self.proposer_tokens, proposer=name).inc(tokens[name])
        offered = proposers.chain_drafts(kinds)  # trees are not served
        drafted = offered > 0
        if not drafted.any():
            return
        accepted = np.where(drafted, acc - 1, 0)
        self.of(self.drafts).inc(int(drafted.sum()))
        self.of(self.draft_tokens).inc(int(offered.sum()))
        self.of(self.accepted).inc(int(accepted.sum()))
        for pos in range(1, int(offered.max()) + 1):
            n = int((accepted >= pos).sum())
            if n:
                self.of(self.accepted_per_pos, position=str(pos)).inc(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)
