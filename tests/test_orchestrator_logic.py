"""Orchestrator logic without a server: config, staleness bound, batches, data order, endpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from prl.config.topology import Advantage, Shaping
from prl.errors import ConfigError, PlanError, StepTimeout
from prl.orchestrator.config import OrchestratorConfig
from prl.orchestrator.rollouts import Branch, Rollout, TaskStream, build_samples
from prl.orchestrator.sync import LiveServer, ServerPool, discover, read_endpoints
from prl.planner.model import Plan
from prl.run.batch import publish_batch, read_batch
from prl.run.records import Endpoint
from prl.run.rundir import RunDir, atomic_write_json
from tests.helpers import publish_endpoint
from testkit.plans import local_plan

GOLDEN = Path(__file__).parent / "golden"


def test_config_from_the_golden_plan_json():
    """What `prl plan configs/local-tiny.yaml` writes is what the orchestrator reads."""
    cfg = OrchestratorConfig.from_plan(Plan.from_json((GOLDEN / "local-tiny" / "plan.json").read_text()))
    env, t = cfg.environment, cfg.training
    assert env.id == "prl_letters" and env.harness == "prl" and env.args == {}
    assert (t.batch_size, t.rollouts_per_example, cfg.examples_per_step) == (32, 4, 8)
    assert t.max_off_policy_steps == 1 and t.max_steps == 25 and t.max_tokens == 16
    assert cfg.dp_size == 2  # dp_replicate 1 * dp_shard 2
    assert cfg.served_model_name == "local-tiny"
    assert cfg.model_path == "models/tiny-qwen3"
    assert t.advantage == Advantage(std_normalize=True)


def test_config_reads_the_settings_the_topology_gives(tmp_path):
    plan = local_plan(tmp_path / "run", tmp_path / "model", [
        "training.advantage.drop_zero_groups=true", "training.max_concurrent_rollouts=8",
        "model.tokenizer=" + str(tmp_path / "tok"), "trainer.dp_replicate=2", "environment.max_turns=3"])
    cfg = OrchestratorConfig.from_plan(plan)
    t = cfg.training
    assert t.advantage == Advantage(std_normalize=True, drop_zero_groups=True) and t.max_concurrent_rollouts == 8
    assert cfg.model_path == str(tmp_path / "tok"), "the tokenizer wins over the model path"
    assert cfg.dp_size == 2  # dp_replicate 2 * dp_shard 1
    assert (cfg.environment.max_turns, cfg.environment.max_total_tokens) == (3, None)
    assert cfg.renderer is None  # chosen from the tokenizer's name
    with pytest.raises(PlanError, match=r"batch_size\(10\) must be a multiple of rollouts_per_example\(4\); use 8"):
        local_plan(tmp_path / "run", tmp_path / "model", ["training.batch_size=10"])
    with pytest.raises(ConfigError, match=r"environment\.id"):
        local_plan(tmp_path / "run", tmp_path / "model", ["environment.id="])


@pytest.mark.parametrize(
    ("k", "step", "oldest"),
    [(0, 1, 0), (0, 2, 1), (0, 7, 6), (1, 1, 0), (1, 2, 0), (1, 3, 1), (2, 10, 7)],
)
def test_staleness_bound(tmp_path, k, step, oldest):
    # step N is trained on by a policy at version N-1; k steps off-policy allows version N-1-k
    cfg = OrchestratorConfig.from_plan(local_plan(tmp_path, tmp_path, [f"training.max_off_policy_steps={k}"]))
    assert cfg.min_version(step) == oldest


def rollout(reward: float, version: int = 0, n_prompt: int = 3, n_completion: int = 2, error: str | None = None):
    ids = list(range(1, n_prompt + n_completion + 1))
    mask = [0] * n_prompt + [1] * n_completion
    lp = [0.0] * n_prompt + [-0.5] * n_completion
    return Rollout(reward, version, [Branch(ids, mask, lp)] if error is None else [], n_completion, error=error)


def shaping(import_path: str, **args) -> Advantage:
    return Advantage(shaping=Shaping(import_path=import_path, args=args))


def test_shipped_shaping_functions_give_per_token_and_per_sample_advantages():
    """token_length_penalty: sampled tokens after the first `free_tokens` lose coef (prompt tokens keep theirs,
    untrained anyway); metric_bonus: the rollout's metric times coef on the whole sample."""
    groups = [[rollout(1.0, n_completion=4), rollout(0.0, n_completion=4)]]
    b = build_samples(groups, shaping("prl.orchestrator.shaping:token_length_penalty", coef=0.25, free_tokens=2),
                      max_tokens=8, min_version=0)
    assert [s.advantage for s in b.samples] == [[0.5, 0.5, 0.5, 0.5, 0.5, 0.25, 0.25],
                                                [-0.5, -0.5, -0.5, -0.5, -0.5, -0.75, -0.75]]
    one, two = rollout(1.0), rollout(0.0)
    one.metrics, two.metrics = {"format": 1.0}, {"format": 0.0}
    b = build_samples([[one, two]], shaping("prl.orchestrator.shaping:metric_bonus", metric="format", coef=0.1),
                      max_tokens=8, min_version=0)
    assert [s.advantage for s in b.samples] == [0.6, -0.5]
    with pytest.raises(ConfigError, match=r"shaping.args.metric: the rollout has no metric 'fmt' \(it has: format\)"):
        build_samples([[one, two]], shaping("prl.orchestrator.shaping:metric_bonus", metric="fmt", coef=0.1),
                      max_tokens=8, min_version=0)


@pytest.mark.parametrize("import_path, args, says", [
    ("prl_nowhere.shape:fn", {}, r"shaping.import_path \(prl_nowhere.shape:fn\): cannot import prl_nowhere.shape"),
    ("prl.orchestrator.shaping:nothing", {}, r"module prl.orchestrator.shaping has no nothing"),
    ("prl.orchestrator.shaping:token_length_penalty", {"cof": 1}, r"shaping.args: .* cannot be called as "
                                                                   r"fn\(inputs, advantage, \*\*args\)"),
    ("math:pi", {}, r"pi is a float, not a function"),
    ("operator:is_", {}, r"returned bool: return a number or one per token \(5\)"),
])
def test_a_shaping_function_that_cannot_work_is_a_one_line_error_naming_the_setting(import_path, args, says):
    with pytest.raises(ConfigError, match=says):
        build_samples([[rollout(1.0), rollout(0.0)]], shaping(import_path, **args), max_tokens=8, min_version=0)


def test_build_samples_advantages_versions_and_failures():
    groups = [
        [rollout(1.0, 2), rollout(0.0, 3)],  # informative
        [rollout(0.5, 2), rollout(0.5, 2)],  # zero advantage
        [rollout(1.0, 2), rollout(0.0, 2, error="ProviderError: 503")],  # failed: dropped whole
    ]
    b = build_samples(groups, Advantage(), max_tokens=8, min_version=2)
    assert b.failed_groups == 1 and b.failed_rollouts == 1 and b.first_error == "ProviderError: 503"
    assert b.zero_groups == 1 and b.dropped_zero_groups == 0 and b.groups_used == 2
    assert [s.advantage for s in b.samples] == [0.5, -0.5, 0.0, 0.0]
    assert [s.policy_version for s in b.samples] == [2, 3, 2, 2]
    assert b.rewards == [1.0, 0.0, 0.5, 0.5]

    dropped = build_samples(groups, Advantage(drop_zero_groups=True), max_tokens=8, min_version=2)
    assert dropped.dropped_zero_groups == 1 and [s.advantage for s in dropped.samples] == [0.5, -0.5]
    assert dropped.rewards == [1.0, 0.0, 0.5, 0.5]  # stats still see the dropped group


def test_all_zero_groups_are_kept_rather_than_an_empty_batch():
    groups = [[rollout(1.0), rollout(1.0)], [rollout(0.0), rollout(0.0)]]
    b = build_samples(groups, Advantage(drop_zero_groups=True), max_tokens=8, min_version=0)
    assert len(b.samples) == 4 and b.dropped_zero_groups == 0 and all(s.advantage == 0.0 for s in b.samples)


def test_a_published_step_whose_metrics_record_was_lost_gets_it_back_on_resume(tmp_path):
    """The orchestrator publishes rollouts/step_N with its metrics record inside, then appends the record; a full
    disk (or a kill) between the two lost the record, and a resumed run starts after step N. `recover_record`
    appends it from the batch, once; a batch without one (published before records rode along) adds nothing."""
    import json

    from prl.orchestrator.loop import RECORD_KEY, recover_record

    run = RunDir(tmp_path / "run").create()
    groups = [[rollout(r, 1, n_prompt=3, n_completion=2) for r in (1.0, 0.0)]]
    samples = build_samples(groups, Advantage(), max_tokens=8, min_version=1).samples
    for step in (1, 2):
        run.append_metrics({"role": "orchestrator", "step": step, "reward_mean": 0.1})
    run.append_metrics({"role": "orchestrator", "step": 2, "eval": True})
    with open(run.metrics_jsonl, "a") as f:
        f.write('{"role": "orchestrator", "step": 3, "rew')  # the line the full disk tore
    lost = {"role": "orchestrator", "step": 3, "reward_mean": 0.25}
    publish_batch(run, 3, samples, dp_size=1, micro_batch_tokens=16, meta={RECORD_KEY: json.dumps(lost)})
    publish_batch(run, 4, samples, dp_size=1, micro_batch_tokens=16)

    assert recover_record(run, 3) is True and recover_record(run, 3) is False
    assert [(r["step"], r.get("reward_mean")) for r in run.read_metrics("orchestrator") if not r.get("eval")] == [
        (1, 0.1), (2, 0.1), (3, 0.25)]
    assert recover_record(run, 2) is False and recover_record(run, 0) is False
    assert recover_record(run, 4) is False and len(run.read_metrics("orchestrator")) == 4


def test_a_stale_sample_is_never_built():
    with pytest.raises(AssertionError, match="policy version 1 < bound 2"):
        build_samples([[rollout(1.0, 1), rollout(0.0, 2)]], Advantage(), max_tokens=8, min_version=2)


def test_samples_publish_as_a_valid_batch(tmp_path):
    run = RunDir(tmp_path / "run").create()
    groups = [[rollout(r, 4, n_prompt=3 + i, n_completion=1 + j) for j, r in enumerate((1.0, 0.2, 0.0))] for i in range(3)]
    b = build_samples(groups, Advantage(std_normalize=True), max_tokens=8, min_version=4)
    publish_batch(run, 5, b.samples, dp_size=2, micro_batch_tokens=16)
    batch = read_batch(run.rollouts(5))
    assert batch.num_samples == 9 and batch.arrays["policy_version"].tolist() == [4] * 9
    off = batch.offsets
    adv = batch.arrays["advantages"]
    for g in range(3):  # each group's per-sample advantages sum to ~0
        assert abs(sum(float(adv[off[i]]) for i in range(3 * g, 3 * g + 3))) < 1e-5
    lp, mask = batch.arrays["inference_logprobs"], batch.arrays["loss_mask"]
    assert all(lp[mask == 0] == 0) and all(lp[mask == 1] == -0.5)
    assert len(batch.micro_batches(0, 2, 16)) == len(batch.micro_batches(1, 2, 16))


def test_task_stream_is_a_function_of_the_step():
    tasks = [f"t{i}" for i in range(10)]
    a, b = TaskStream(tasks, seed=1), TaskStream(tasks, seed=1)
    steps = [a.tasks_for(s, 4) for s in range(1, 6)]
    assert [b.tasks_for(s, 4) for s in (5, 3, 1)] == [steps[4], steps[2], steps[0]]  # any order, same draw
    first_epoch = [t for s in steps[:2] for t in s] + steps[2][:2]
    assert sorted(first_epoch) == sorted(tasks)  # an epoch is a permutation
    assert TaskStream(tasks, seed=2).tasks_for(1, 4) != steps[0]
    with pytest.raises(ConfigError, match="no tasks"):
        TaskStream([], seed=0)


def test_pool_picks_least_busy_server_new_enough():
    s1, s2, s3 = LiveServer("http://a", version=3), LiveServer("http://b", version=2), LiveServer("http://c", version=3)
    pool = ServerPool(generate=[s1, s2, s3], admin=[s1, s2, s3])
    s1.inflight, s3.inflight = 5, 1
    assert pool.pick(3) is s3
    assert pool.pick(2) is s2  # least busy overall
    assert pool.pick(3, avoid=s3) is s1  # a retry goes elsewhere
    assert pool.pick(4) is None
    assert pool.version == 2
    router = LiveServer("http://router", role="router")
    pd = ServerPool(generate=[router], admin=[s1, s2])
    assert pd.version_of(router) == 2  # a router serves the oldest version behind it


def test_endpoints_from_the_run_dir(tmp_path):
    run = RunDir(tmp_path / "run").create()
    plan = local_plan(run.root, tmp_path / "model", topology="moe-30b-pd")
    assert plan.expected_endpoints() == {("prefill", i) for i in range(4)} | {("decode", 0), ("decode", 1), ("router", 0)}
    for i in range(4):
        publish_endpoint(run, "prefill", i, f"http://p{i}:8000/")
    for i in range(2):
        publish_endpoint(run, "decode", i, f"http://d{i}:8000")
    run.write_endpoint(Endpoint(role="decode", index=1001, host="d1"))  # a multi-node head's address: no url
    atomic_write_json(run.endpoint("decode", 7), {"url": "http://old:1"})  # another prl's file: not read
    with pytest.raises(StepTimeout, match="router.0"):
        discover(run, plan, timeout=0.2)
    publish_endpoint(run, "router", 0, "http://r:8090")
    assert read_endpoints(run)["prefill"][0] == "http://p0:8000"
    pool = discover(run, plan, timeout=1)
    assert [s.url for s in pool.generate] == ["http://r:8090"]
    assert sorted(s.url for s in pool.admin) == sorted([f"http://p{i}:8000" for i in range(4)] + ["http://d0:8000", "http://d1:8000"])


def test_eval_reports_progress_as_each_group_finishes():
    """The orchestrator's heartbeat ticks during eval (an eval longer than the hang bound is not a hang), once per
    finished group and only after it finished; a group that never finishes ticks nothing."""
    import asyncio
    from types import SimpleNamespace

    from prl.orchestrator.eval import evaluate

    finished: list[int] = []
    ticks: list[list[int]] = []

    async def group(task: int, n: int, _min_version: int) -> list[Rollout]:
        await asyncio.sleep(0.01 * (3 - task))  # the last task finishes first
        finished.append(task)
        return [Rollout(reward=float(task), version=0, branches=[], completion_tokens=1) for _ in range(n)]

    gen = SimpleNamespace(env=SimpleNamespace(taskset=SimpleNamespace(take=lambda k: list(range(k)))), group=group)
    out = asyncio.run(evaluate(gen, 3, rollouts=2, on_group=lambda: ticks.append(list(finished))))
    assert ticks == [[2], [2, 1], [2, 1, 0]] and out["rollouts"] == 6


def fake_trace(reward: float, ids: list[int], *, trainable: bool = True, name: str = "agent"):
    """What `rollout_from_episode` reads of a verifiers Trace: one trainable branch, a reward, a metric."""
    from types import SimpleNamespace

    branch = SimpleNamespace(trainable=True, token_ids=ids, sampled_mask=[0] + [1] * (len(ids) - 1),
                             logprobs=[0.0] + [-1.0] * (len(ids) - 1),
                             messages=[SimpleNamespace(role="user", content="text only")])
    return SimpleNamespace(agent=SimpleNamespace(trainable=trainable, name=name), branches=[branch], errors=[],
                           messages=branch.messages,  # the final branch's, as a Trace's
                           metrics={f"{name}_turns": 2.0}, rewards={}, reward=reward, is_truncated=False,
                           num_turns=2)


def test_an_untrainable_agent_is_neither_trained_on_nor_rewarded():
    """A simulated user's trace (agent.trainable False) is the environment: no samples, no share of the reward."""
    from types import SimpleNamespace

    from prl.orchestrator.rollouts import rollout_from_episode

    policy, user = fake_trace(1.0, [1, 2, 3]), fake_trace(0.0, [7, 8, 9, 10], trainable=False, name="user")
    r = rollout_from_episode(SimpleNamespace(ok=True, errors=[], traces=[policy, user]), version=3)
    assert r.ok and r.reward == 1.0 and r.completion_tokens == 2 and r.turns == 2
    assert [b.token_ids for b in r.branches] == [[1, 2, 3]]
    assert r.metrics == {"agent_turns": 2.0}
    assert [(t.role, t.text) for t in r.conversation] == [("user", "text only")]  # the policy's trace only
    alone = rollout_from_episode(SimpleNamespace(ok=True, errors=[], traces=[user]), version=3, need_tokens=False)
    assert alone.error == "episode has no trace of a trainable agent"


def test_a_rollout_waiting_for_weights_does_not_hold_a_concurrency_slot():
    """One slot: a rollout that needs weights no server has yet waits outside it (ticking the heartbeat),
    so a rollout that can run now runs; the waiting one runs once the server catches up."""
    import asyncio
    from types import SimpleNamespace

    from prl.orchestrator.rollouts import Generator

    server = LiveServer("http://a", version=0)
    ticks: list[float] = []
    pool = ServerPool(generate=[server], admin=[server], on_idle=lambda: ticks.append(1.0))
    ran: list[int] = []

    async def run_slot(slot, ctx):
        ran.append(pool.version_of(server))
        return SimpleNamespace(ok=True, errors=[], traces=[fake_trace(1.0, [1, 2])])

    env = SimpleNamespace(run_slot=run_slot)
    gen = Generator(env, pool, lambda s: None, max_concurrent=1, retries=0)
    task = SimpleNamespace(key="t")

    async def main():
        waiting = asyncio.create_task(gen.rollout(task, min_version=1))
        await asyncio.sleep(0.05)
        now = await asyncio.wait_for(gen.rollout(task, min_version=0), 2)  # before the fix: blocked forever
        assert now.ok and now.version == 0 and not waiting.done() and ticks
        server.version = 1
        later = await asyncio.wait_for(waiting, 2)
        assert later.ok and later.version == 1

    asyncio.run(main())
    assert ran == [0, 1]


def test_the_renderer_setting_reaches_the_train_client(tmp_path):
    """`model.renderer` goes from the topology through the plan to the train client's typed renderer config;
    one renderers refuses is a ConfigError that names the field."""
    from renderers import CustomRendererConfig, Qwen3RendererConfig

    from prl.orchestrator.clients import renderer_config

    chatml = "{name: custom, import_path: prl.orchestrator.chatml.ChatMLRenderer}"
    cfg = OrchestratorConfig.from_plan(local_plan(tmp_path / "run", tmp_path / "model", [f"model.renderer={chatml}"]))
    assert cfg.renderer == {"name": "custom", "import_path": "prl.orchestrator.chatml.ChatMLRenderer"}
    typed = renderer_config(cfg.renderer)
    assert isinstance(typed, CustomRendererConfig) and typed.import_path == "prl.orchestrator.chatml.ChatMLRenderer"
    assert renderer_config({"name": "qwen3", "enable_thinking": False}) == Qwen3RendererConfig(enable_thinking=False)
    assert renderer_config(None) is None
    with pytest.raises(ConfigError, match=r"model.renderer .*qwen3.no_such_field: Extra inputs are not permitted"):
        renderer_config({"name": "qwen3", "no_such_field": 1})
    with pytest.raises(ConfigError, match=r"model.renderer .*ModuleNotFoundError: No module named 'no_such_module'"):
        renderer_config({"name": "custom", "import_path": "no_such_module.Renderer"})
