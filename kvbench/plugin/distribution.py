"""pytest-xdist workers and ``--kvbench-shard`` across machines: timed tests kept on one worker, shards
selected, workers' results handed to the controller and merged."""

from __future__ import annotations

from typing import Any

import pytest

from kvbench.plugin.session import KvbenchSession, is_xdist_worker

#: the xdist group every timed test joins, so ``--dist loadgroup`` runs them one after another on one worker
TIMED_GROUP = "kvbench-timed"
#: the key of ``config.workeroutput`` a worker sends its results, near-ties and findings under
WORKER_OUTPUT_KEY = "kvbench"
_SHARD_NODEID_KEY = pytest.StashKey[str]()


def configure_distribution(config: pytest.Config, ks: KvbenchSession) -> None:
    """Check ``--kvbench-shard`` and the benchmark/xdist combination; register :class:`Distribution`."""
    shard = None
    if config.getoption("kvbench_shard"):
        from kvbench.bench.shards import ShardError, parse_shard

        try:
            shard = parse_shard(config.getoption("kvbench_shard"))
        except ShardError as e:
            raise pytest.UsageError(str(e)) from None
        ks.run_name += f"-shard{shard.index}of{shard.count}"
    # xdist rewrites a worker's --dist to "no"; the controller's is the one the user chose
    dist = "no" if is_xdist_worker(config) or not config.getoption("tx", None) else config.getoption("dist", "no")
    if ks.benchmark and dist not in ("no", "loadgroup"):
        raise pytest.UsageError(
            f"--benchmark with pytest-xdist (-n/--tx) needs --dist loadgroup, got --dist {dist}: timed benchmarks "
            f"must run one after another on one worker, never on two workers sharing this machine's cores. Add "
            f"--dist loadgroup, or drop -n for the benchmark run.")
    config.pluginmanager.register(Distribution(ks, shard), "kvbench-distribution")


def _is_timed(item: pytest.Item) -> bool:
    return item.get_closest_marker("benchmark") is not None or "benchmark" in getattr(item, "fixturenames", ())


class Distribution:
    """pytest-xdist and ``--kvbench-shard``: what a run spread over processes or machines needs.

    * On an xdist worker, timed tests (marked ``benchmark`` or using pytest-benchmark's fixture) join
      the xdist group :data:`TIMED_GROUP`, so ``--dist loadgroup`` sends them all to one worker.
    * ``--kvbench-shard I/N`` deselects the tests of other shards (:mod:`kvbench.bench.shards`), keyed
      by the node ids collected before xdist appends ``@group``.
    * A worker hands its results (benchmarks), near-ties and findings to the controller through
      ``workeroutput``; the controller merges them (:func:`kvbench.bench.merge.merge_results`) before it
      writes the one ``results.json`` and report. Conformance records need no hand-over: the
      controller rebuilds them from the test reports, which carry their evidence.
    """

    def __init__(self, ks: KvbenchSession, shard: Any):
        self.ks = ks
        self.shard = shard  # kvbench.bench.shards.Shard | None
        self.worker_parts: list[tuple[str, Any]] = []  # (worker id, Results) in the order workers finished

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]):
        worker = is_xdist_worker(config)
        for item in items:
            item.stash[_SHARD_NODEID_KEY] = item.nodeid
            if worker and _is_timed(item):
                item.add_marker(pytest.mark.xdist_group(name=TIMED_GROUP))
        result = yield
        if self.shard is not None:  # after -k/-m deselection, so shards split what was selected
            from kvbench.bench.shards import in_shard

            # a benchmark's engines stay in one shard: they are served side by side
            units = {item.stash[_SHARD_NODEID_KEY]: _shard_unit(item) for item in items}
            keep = in_shard(units, self.shard, unit_of=units.__getitem__)
            dropped = [item for item in items if item.stash[_SHARD_NODEID_KEY] not in keep]
            if dropped:
                config.hook.pytest_deselected(items=dropped)
                items[:] = [item for item in items if item.stash[_SHARD_NODEID_KEY] in keep]
        return result

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        """(xdist controller) a worker finished: keep what it sent."""
        import json

        raw = (getattr(node, "workeroutput", None) or {}).get(WORKER_OUTPUT_KEY)
        if raw is None:  # a crashed worker sends nothing; xdist reports the crash itself
            return
        payload = json.loads(raw)
        if payload.get("results") is not None:
            from kvbench.bench.results import Results

            worker_id = getattr(getattr(node, "gateway", None), "id", "?")
            self.worker_parts.append((f"worker {worker_id}", Results.from_dict(payload["results"])))
        self.ks.near_ties.extend(payload.get("near_ties") or [])
        self.ks.findings.extend(payload.get("findings") or [])

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """A worker sends; the controller (or a plain run) merges and labels, before results are written."""
        import json

        config, ks = session.config, self.ks
        if is_xdist_worker(config):
            config.workeroutput[WORKER_OUTPUT_KEY] = json.dumps(  # type: ignore[attr-defined]
                {"results": ks.results.data if ks.results is not None else None, "near_ties": ks.near_ties,
                 "findings": ks.findings})
            return
        if self.worker_parts:
            from kvbench.bench.merge import merge_results
            from kvbench.bench.results import command_line

            parts = ([("controller", ks.results)] if ks.results is not None else []) + self.worker_parts
            ks.results = merge_results(parts)
            # the controller's: a worker's argv is not what was typed
            ks.results.data["command"] = ks.redacted(command_line())
        if self.shard is not None and (ks.results is not None or ks.conformance):
            ks.get_results().data["shard"] = self.shard.to_dict()


def _shard_unit(item: pytest.Item) -> str:
    """The unit ``--kvbench-shard`` keeps together: a benchmark without its engine parameter (its
    engines are served side by side, so their times pair up only within one run), else the test."""
    nodeid = item.stash[_SHARD_NODEID_KEY]
    callspec = getattr(item, "callspec", None)
    if item.get_closest_marker("benchmark") is None or callspec is None or "engine_spec" not in callspec.params:
        return nodeid
    others = [f"{k}={v!r}" for k, v in sorted(callspec.params.items()) if k != "engine_spec"]
    return nodeid.split("[", 1)[0] + (f"[{','.join(others)}]" if others else "")
