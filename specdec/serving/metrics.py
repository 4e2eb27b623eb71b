"""Prometheus metrics of the serving engine (``prometheus_client``, one registry per engine).

Counters, gauges and histograms (names prefixed ``specdec_``):

    requests_total{outcome}        finished requests: stop, length, abort, error; rejected (queue full)
    prompt_tokens_total            prompt tokens of accepted requests
    prompt_tokens_cached_total     prompt tokens whose KV a row kept from an earlier request (``prefix_cache``)
    prefix_store_bytes, prefix_store_entries, prefix_store_restored_total   the host store of prefixes rows gave
                                   up (``prefix_cache_mb``): its bytes, its entries, those restored into a row
    generation_tokens_total        tokens streamed to clients
    queue_depth, rows_in_use, rows requests waiting, rows occupied, rows of the static batch
    time_to_first_token_seconds    arrival → first token (queueing included)
    inter_token_latency_seconds    per token: the gap between deliveries / tokens in the delivery
    queue_time_seconds             arrival → a row
    spec_steps_total, spec_draft_tokens_total, spec_accepted_tokens_total   row-steps, drafted, accepted
    spec_mean_acceptance_length    tau = 1 + accepted / steps (1 without speculation)
    spec_position_acceptance{position}   accepted at draft position i / steps
    suffix_cache_tokens, suffix_cache_max_tokens, suffix_cache_sequences   suffix strategies: what the one
                                   cache of the served model holds (tokens, its budget, finished outputs)
    suffix_cache_lookups_total, suffix_cache_hits_total, suffix_cache_hit_rate   cache lookups, those that
                                   found a match, hits / lookups
    suffix_cache_added_total, suffix_cache_evicted_total   finished outputs added, evicted (LRU)

The speculation values are read from the engine's ``SpecStats`` at scrape time (vLLM's definitions), the
suffix cache's from its ``stats()`` (a proposer declaring "cache": ``specdec.speculation.proposer``).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServingMetrics:
    """The metrics of one ``AsyncEngine`` (``watch`` connects the gauges and speculation values)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdec_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens streamed to clients", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time per output token after the first",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("specdec_queue_time_seconds", "Arrival to a row", buckets=LATENCY_BUCKETS,
                                    registry=r)
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting for a row", registry=r)
        self.rows_in_use = Gauge("specdec_rows_in_use", "Rows of the static batch occupied", registry=r)
        self.rows = Gauge("specdec_rows", "Rows of the static batch", registry=r)

    def watch(self, engine) -> None:
        """Read queue depth, rows and speculation counters from ``engine`` (an ``AsyncEngine``) at scrape time."""
        self.queue_depth.set_function(lambda: engine.num_waiting)
        self.rows_in_use.set_function(lambda: engine.rows_in_use)
        self.rows.set(engine.target.batch_size)
        self.registry.register(_SpecCollector(engine.engine))
        self.registry.register(_PromptCacheCollector(engine.target))
        speculator = engine.engine.speculator          # (the core engine's; None: target only)
        cache = None if speculator is None else speculator.proposer.cache
        if cache is not None:
            self.registry.register(_SuffixCacheCollector(cache))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)


class _PromptCacheCollector:
    """Prompt tokens the target's prefix cache kept (``DecoderModel.prompt_tokens_kept``)."""

    def __init__(self, target):
        self.target = target

    def collect(self):
        yield CounterMetricFamily("specdec_prompt_tokens_cached", "Prompt tokens whose KV a row kept from an "
                                  "earlier request (prefix_cache)", value=self.target.prompt_tokens_kept)
        store = self.target.prefix_store
        if store is not None:
            s = store.stats()
            yield GaugeMetricFamily("specdec_prefix_store_bytes", "Host memory of the stored prefixes' KV",
                                    value=s["bytes"])
            yield GaugeMetricFamily("specdec_prefix_store_entries", "Stored prefixes", value=s["entries"])
            yield CounterMetricFamily("specdec_prefix_store_restored", "Stored prefixes restored into a row",
                                      value=s["restored"])


class _SpecCollector:
    """Speculation counters from a core ``Engine``'s cumulative ``SpecStats``."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats.copy()
        for name, value, doc in (("steps", s.steps, "Row-steps"), ("draft_tokens", s.drafted, "Draft tokens proposed"),
                                 ("accepted_tokens", s.accepted, "Draft tokens accepted")):
            yield CounterMetricFamily(f"specdec_spec_{name}", doc, value=value)
        yield GaugeMetricFamily("specdec_spec_mean_acceptance_length", "tau = 1 + accepted / steps",
                                value=s.mean_acceptance_length)
        per_position = GaugeMetricFamily("specdec_spec_position_acceptance", "Accepted at draft position / steps",
                                         labels=["position"])
        for i, a in enumerate(s.per_position_acceptance):
            per_position.add_metric([str(i)], a)
        yield per_position


class _SuffixCacheCollector:
    """A suffix cache's size and hit rate (``SuffixCache.stats()``, one consistent read per scrape)."""

    def __init__(self, cache):
        self.cache = cache

    def collect(self):
        s = self.cache.stats()
        for name, doc in (("tokens", "Tokens the suffix cache holds"),
                          ("max_tokens", "The suffix cache's token budget"),
                          ("sequences", "Finished outputs the suffix cache holds"),
                          ("hit_rate", "Suffix cache lookups that found a match / lookups")):
            yield GaugeMetricFamily(f"specdec_suffix_cache_{name}", doc, value=s[name])
        for name, doc in (("lookups", "Suffix cache lookups"), ("hits", "Suffix cache lookups that found a match"),
                          ("added", "Finished outputs added to the suffix cache"),
                          ("evicted", "Outputs evicted from the suffix cache (least recently used)")):
            yield CounterMetricFamily(f"specdec_suffix_cache_{name}", doc, value=s[name])
