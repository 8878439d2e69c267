"""`moe-rl plan`: parameter counts against published totals, hand-computed formulas, memory and
traffic estimates, and every divisibility constraint failing by name."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from launch.plan import make_plan, node_overrides
from moe_rl.config import load_recipe
from moe_rl.config.derived import GIB
from moe_rl.config.modes import Attention
from moe_rl.config.schema import ModelConfig
from moe_rl.orchestration.preflight import load_checked
from moe_rl.planner.flops import attention_params, attention_weights, count_params, mlp_weights, model_flops
from moe_rl.planner.memory import quant_bytes_per_weight, rollout_weight_bytes, routing_trace_bytes_per_token
from moe_rl.rules import Rule

REPO = Path(__file__).resolve().parents[3]
RECIPES = REPO / "recipes"

# (recipe, published total, published active, which active count the publisher uses, tolerance of
# the active check). Totals must be within 1 %. Sources: DeepSeek-V3 README_WEIGHTS (671B total,
# 36.6B activated without the input embedding); Kimi-K2 model card / Hugging Face (1026.5B counted
# from the checkpoint; the report rounds to 1.04T) and report (32.6B activated); Qwen3 model cards
# (235B / 22B, 30.5B / 3.3B; 3.35B is printed as 3.3B, hence 2 %).
PUBLISHED = [
    ("deepseek_v3", 671e9, 36.6e9, "active_without_embedding", 0.01),
    ("kimi_k2", 1026.5e9, 32.6e9, "active", 0.01),
    ("qwen3_235b_a22b", 235e9, 22e9, "active", 0.01),
    ("qwen3_30b_a3b", 30.5e9, 3.3e9, "active", 0.02),
]


def _plan(recipe: str, *overrides: str):
    return make_plan(load_recipe(RECIPES / f"{recipe}.yaml", list(overrides)), paths=False)


@pytest.mark.parametrize(
    ("recipe", "total", "active", "kind", "tol"), PUBLISHED, ids=[p[0] for p in PUBLISHED]
)
def test_parameter_counts_match_published(recipe, total, active, kind, tol):
    counts = count_params(load_checked(RECIPES / f"{recipe}.yaml", paths=False).model)
    assert counts.total == pytest.approx(total, rel=0.01)
    assert getattr(counts, kind) == pytest.approx(active, rel=tol)


def test_kimi_k2_total_is_near_the_reported_one_point_zero_four_trillion():
    counts = count_params(load_checked(RECIPES / "kimi_k2.yaml", paths=False).model)
    assert counts.total == pytest.approx(1.04e12, rel=0.015)  # 1.0264T; the report rounds to 1.04T


def test_gqa_formula_by_hand():
    m = ModelConfig(vocab_size=10, hidden_size=4, num_layers=2, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=3, moe_ffn_hidden_size=5, num_experts=4, moe_router_topk=2)  # fmt: skip
    c = count_params(m)
    attention = 4 * 2 * 3 + 2 * 4 * 1 * 3 + 2 * 3 * 4 + 2 * 3  # q, k+v, o, q/k norms
    assert c.attention_per_layer == attention == 78
    layer = attention + 2 * 4 + 4 * 4 + 4 * 3 * 4 * 5  # + norms, router, 4 experts
    assert c.total == 10 * 4 * 2 + 4 + 2 * layer
    assert c.active == c.total - 2 * 2 * (3 * 4 * 5)  # two unused experts per layer


def test_mla_formula_by_hand():
    m = ModelConfig(family="deepseek_v3", attention="mla", vocab_size=10, hidden_size=8, num_layers=3,
                    num_attention_heads=2, q_lora_rank=4, kv_lora_rank=3, qk_nope_head_dim=2,
                    qk_rope_head_dim=1, v_head_dim=2, ffn_hidden_size=6, moe_ffn_hidden_size=2, num_experts=4,
                    moe_router_topk=1, first_k_dense_layers=1, num_shared_experts=1,
                    moe_router_enable_expert_bias=True, tie_word_embeddings=True)  # fmt: skip
    c = count_params(m)
    q = 8 * 4 + 4 + 4 * 2 * 3
    kv = 8 * (3 + 1) + 3 + 3 * 2 * (2 + 2)
    assert c.attention_per_layer == q + kv + 2 * 2 * 8 == 151
    expert = 3 * 8 * 2
    dense_layer = 151 + 16 + 3 * 8 * 6
    moe_layer = 151 + 16 + (8 * 4 + 4) + expert + 4 * expert
    assert c.lm_head == 0
    assert c.total == 10 * 8 + 8 + dense_layer + 2 * moe_layer
    assert c.active_without_embedding == c.total - 80 - 2 * 3 * expert


def test_routing_trace_width_follows_expert_count():
    deepseek = load_checked(RECIPES / "deepseek_v3.yaml", paths=False).model
    kimi = load_checked(RECIPES / "kimi_k2.yaml", paths=False).model
    qwen = load_checked(RECIPES / "qwen3_30b_a3b.yaml", paths=False).model
    assert routing_trace_bytes_per_token(deepseek) == 58 * 8  # 256 experts: uint8
    assert routing_trace_bytes_per_token(kimi) == 60 * 8 * 2  # 384 experts: uint16
    assert routing_trace_bytes_per_token(qwen) == 384  # half the published int16 trace (768 B)


def test_fp8_weight_sync_is_about_half_of_bf16():
    config = load_checked(RECIPES / "kimi_k2.yaml", paths=False)
    counts = count_params(config.model)
    ratio = rollout_weight_bytes(config, counts) / (2 * counts.total)
    assert 0.5 < ratio < 0.51
    assert (
        quant_bytes_per_weight(
            load_checked(RECIPES / "kimi_k2.yaml", ["rollout.quant=bf16"], paths=False).quant
        )
        == 2
    )
    assert (
        quant_bytes_per_weight(
            load_checked(RECIPES / "kimi_k2.yaml", ["rollout.quant=nvfp4"], paths=False).quant
        )
        < 0.6
    )


def test_distributed_optimizer_shards_adam_states():
    sharded = _plan("qwen3_30b_a3b").trainer
    whole = _plan("qwen3_30b_a3b", "parallel.use_distributed_optimizer=false").trainer
    assert whole.optimizer == pytest.approx(12 * whole.params, rel=1e-6)
    assert sharded.optimizer < whole.optimizer / 2  # DP 8 for dense, expert-DP 2 for experts
    assert whole.weights == sharded.weights


def test_recompute_shrinks_activations():
    assert (
        _plan("deepseek_v3").trainer.activations
        < _plan("deepseek_v3", "trainer.recompute_activations=false").trainer.activations / 5
    )


@pytest.mark.parametrize("recipe", ["qwen3_30b_a3b", "qwen3_235b_a22b", "deepseek_v3", "kimi_k2"])
def test_large_recipes_pass(recipe):
    plan = _plan(recipe)
    assert plan.ok, [(c.name, c.detail) for c in plan.failures]
    assert all(c.ok for c in plan.checks), [c.name for c in plan.checks if not c.ok]


@pytest.mark.parametrize(
    ("recipe", "overrides", "failing"),
    [
        ("kimi_k2", ["parallel.tensor_model_parallel_size=3"], "heads % TP"),
        (
            "qwen3_30b_a3b",
            ["parallel.tensor_model_parallel_size=8", "parallel.trainer_world_size=16"],
            "query groups % TP",
        ),
        ("qwen3_235b_a22b", ["parallel.pipeline_model_parallel_size=4"], "layers % PP"),
        (
            "qwen3_235b_a22b",
            ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2"],
            "no virtual pipeline stages",
        ),
        ("qwen3_30b_a3b", ["parallel.virtual_pipeline_model_parallel_size=2"], "no virtual pipeline stages"),
        ("deepseek_v3", ["parallel.expert_model_parallel_size=48"], "experts % EP"),
        ("deepseek_v3", ["parallel.trainer_world_size=252"], "world % (TP*PP*CP)"),
        (
            "kimi_k2",
            ["parallel.expert_model_parallel_size=128", "parallel.expert_tensor_parallel_size=4"],
            "world % (EP*ETP*PP)",
        ),
        ("qwen3_30b_a3b", ["parallel.sequence_parallel=false"], "EP with TP needs sequence parallel"),
        ("twins/kimi_k2", ["parallel.sequence_parallel=true"], "sequence parallel needs TP > 1"),
        ("deepseek_v3", ["parallel.expert_tensor_parallel_size=3"], "expert FFN % ETP"),
        ("deepseek_v3", ["model.moe_router_group_topk=9"], "router groups"),
        ("qwen3_30b_a3b", ["rollout.batch_size=496"], "batch % (mini-batches*DP)"),
        ("qwen3_30b_a3b", ["trainer.max_tokens_per_microbatch=4096"], "micro-batch holds a sequence"),
        (
            "kimi_k2",
            [
                "parallel.context_parallel_size=2",
                "algo.routing_replay=off",
                "trainer.max_tokens_per_microbatch=32760",
            ],
            "micro-batch % CP chunks",
        ),
        ("kimi_k2", ["parallel.context_parallel_size=2"], "replay without context parallelism"),
        ("kimi_k2", ["cluster.nodes=65"], "nodes = trainer + rollout"),
        ("kimi_k2", ["cluster.trainer_nodes=47", "cluster.nodes=63"], "trainer GPUs = world"),
        ("kimi_k2", ["rollout.num_engines=9"], "engine GPUs"),
        ("kimi_k2", ["rollout.tensor_parallel_size=48", "rollout.num_engines=2"], "engine capabilities"),
        ("deepseek_v3", ["cluster.gpu_memory_gib=40"], "trainer states fit"),
        ("deepseek_v3", ["rollout.tensor_parallel_size=8", "rollout.num_engines=8"], "rollout weights fit"),
        ("kimi_k2", ["rollout.gpu_memory_utilization=0.43"], "KV cache holds a sequence"),
    ],
)
def test_constraint_failures_are_named(recipe, overrides, failing):
    plan = _plan(recipe, *overrides)
    assert not plan.ok
    assert failing in [c.name for c in plan.failures], [(c.name, c.detail) for c in plan.failures]


def test_nodes_flag_resizes_the_trainer():
    config = load_checked(RECIPES / "kimi_k2.yaml", paths=False)
    assert node_overrides(config, 96, None) == [
        "cluster.nodes=96",
        "cluster.trainer_nodes=80",
        "parallel.trainer_world_size=640",
    ]
    assert node_overrides(config, None, None) == []


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "launch.cli", "plan", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_cli_plan_passes_and_fails_with_exit_codes():
    ok = _cli("recipes/deepseek_v3.yaml", "--skip-path-checks")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "671.03 B" in ok.stdout and ok.stdout.rstrip().endswith("PASS")
    bad = _cli("recipes/kimi_k2.yaml", "--nodes", "63", "--skip-path-checks")
    assert bad.returncode == 1
    assert "FAIL: " in bad.stdout and "world % (EP*ETP*PP)" in bad.stdout
    # as shipped, the dataset is not in this checkout and the model starts from random weights
    shipped = _cli("recipes/kimi_k2.yaml")
    assert (
        shipped.returncode == 1
        and "FAIL: dataset exists (data.task=file:data/dapo_math_17k.jsonl: no such"
        in " ".join(shipped.stdout.split())
    )
    assert re.search(r"model weights given\s+│ warn", shipped.stdout), shipped.stdout


def test_plan_imports_no_heavy_library():
    code = textwrap.dedent(
        """
        import sys
        from launch.plan import plan_command
        plan_command("recipes/kimi_k2.yaml")
        print("heavy:" + ",".join(m for m in ("torch", "ray", "megatron", "vllm") if m in sys.modules))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "heavy:"


def test_a_row_that_holds_shows_its_values_not_the_advice_of_its_refusal():
    """The row of a rule that holds shows the values its owner states (`Rule.values`); a refused
    or warning row shows them and the advice (`Rule.advice`), as the refusal says them."""
    from launch.plan import shown_detail
    from moe_rl.trainer.rules import trainer_rules

    def shaping(*overrides: str):
        config = load_recipe(RECIPES / "tiny_moe.yaml", list(overrides))
        return next(r for r in trainer_rules(config) if r.name == "zero-variance shaping shapes advantages")

    holds = shaping()
    assert holds.ok and shown_detail(holds) == "algo.zero_variance_shaping=False with algo.objective=espo"
    refused = shaping("algo.objective=dgo", "algo.zero_variance_shaping=true")
    said = (
        "algo.zero_variance_shaping=True with algo.objective=dgo: DGO trains on sample weights, not "
        "advantages; turn one of them off"
    )
    assert refused.broken and shown_detail(refused) == refused.detail == said
    warns = Rule("warned", False, "x=1", fatal=False, advice="set x=2")
    assert shown_detail(warns) == "x=1: set x=2"
    plan = _plan("deepseek_v3")
    kv = next(c for c in plan.checks if c.name == "KV cache holds a sequence")
    values = f"{plan.rollout.kv_tokens} tokens per engine, longest sequence 10240"
    assert kv.ok and shown_detail(kv) == kv.detail == values


def test_plan_counts_attention_with_the_flops_projection_sizes():
    """One home for the projection arithmetic: a layer's attention parameters are the projections
    `moe_rl.planner.flops` counts FLOPs with, plus the norms."""
    for recipe in ("deepseek_v3", "kimi_k2", "qwen3_30b_a3b"):
        m = load_checked(RECIPES / f"{recipe}.yaml", paths=False).model
        norms = (m.q_lora_rank or 0) + m.kv_lora_rank if m.attention == Attention.MLA else 2 * m.head_dim
        assert attention_params(m) == attention_weights(m) + norms
        assert model_flops(m).attention == 2 * m.num_layers * attention_weights(m)
        counts = count_params(m)
        assert counts.expert == mlp_weights(m.hidden_size, m.moe_ffn_hidden_size)


def test_lora_keeps_the_weights_and_drops_the_bases_gradients_and_adam_state():
    """With lora.rank > 0 the trainer GPU holds every weight plus the adapters, and gradients and
    Adam state for the adapters alone (DeepSeek-V3 as shipped: from 60 GiB a GPU to 13.5)."""
    from launch.plan import _memory_rows, _traffic_rows
    from moe_rl.planner.flops import lora_param_counts
    from moe_rl.planner.memory import layout, trainer_memory

    full = load_recipe(REPO / "recipes" / "deepseek_v3.yaml")
    lora = load_recipe(REPO / "recipes" / "deepseek_v3.yaml", ["lora.rank=8"])
    counts = count_params(full.model)
    before, after = trainer_memory(full, counts), trainer_memory(lora, counts)
    adapters = lora_param_counts(lora.model, lora.lora)
    assert 0 < after.adapters < adapters.total  # a GPU's share
    lay = layout(lora)
    # one MoE layer's experts' adapters over EP and one layer's attention adapters over TP are in it
    assert after.adapters >= adapters.expert * adapters.num_experts / (lay.ep * lay.etp)
    assert after.params == before.params + after.adapters
    assert after.weights == pytest.approx(before.weights + 2 * after.adapters)  # bf16
    assert after.grads == pytest.approx(4 * after.adapters)  # fp32, adapters only
    assert 0 < after.optimizer <= 12 * after.adapters
    assert after.total < 0.25 * before.total
    rows = dict(_memory_rows(make_plan(lora, paths=False)))
    assert rows["  LoRA adapters (rank 8)"] and "  gradients (fp32), adapters only" in rows
    # an adapter-only sync (lora.sync=adapters) carries what trains, in bf16: 4.63 GiB, not 627
    traffic = dict(_traffic_rows(make_plan(lora, paths=False)))
    gib = adapters.total * 2 / (1 << 30)
    assert traffic["weight sync / step, LoRA adapters only"].startswith(f"{gib:,.2f} GiB per engine")
    assert "weight sync / step, LoRA adapters only" not in dict(_traffic_rows(make_plan(full, paths=False)))


def test_a_critic_adds_its_weights_gradients_and_adam_state():
    """With algo.advantage=gae the trainer GPU also holds the critic: the policy's parameters with a
    value head (hidden_size weights) for the LM head, in the same bytes per parameter; the plan's
    memory table shows the row, the total and the colocated release include it."""
    from launch.plan import _memory_rows
    from moe_rl.planner.memory import layout, released_bytes, trainer_memory

    grpo = load_recipe(REPO / "recipes" / "qwen3_30b_a3b.yaml")
    ppo = load_recipe(REPO / "recipes" / "qwen3_30b_a3b.yaml", ["algo.advantage=gae", "rollout.group_size=1"])
    counts = count_params(grpo.model)
    policy, with_critic = trainer_memory(grpo, counts), trainer_memory(ppo, counts)
    assert policy.critic == 0 and with_critic.critic > 0
    lay = layout(grpo)
    assert lay.pp == 1 and grpo.parallel.use_distributed_optimizer
    # a dense parameter: bf16 weight, fp32 gradient, Adam's 12 bytes over the data-parallel ranks
    dense_bytes = 2 + 4 + 12 / lay.dp
    head_change = (counts.lm_head - grpo.model.hidden_size) / lay.tp
    assert with_critic.critic == pytest.approx(policy.static - head_change * dense_bytes, rel=1e-9)
    assert with_critic.total == pytest.approx(policy.total + with_critic.critic)
    colocated = load_recipe(
        REPO / "recipes" / "qwen3_30b_a3b.yaml",
        ["algo.advantage=gae", "rollout.group_size=1", "cluster.rollout_nodes=0"],
    )
    assert released_bytes(colocated, policy) > 0
    assert released_bytes(colocated, with_critic) - released_bytes(colocated, policy) == pytest.approx(
        with_critic.critic
    )
    rows = dict(_memory_rows(make_plan(ppo, paths=False)))
    assert "  critic (weights, grads, Adam)" in rows
    assert "  critic (weights, grads, Adam)" not in dict(_memory_rows(make_plan(grpo, paths=False)))


def test_a_teacher_adds_its_frozen_weights_unless_offloaded():
    """A distillation teacher read from teacher.model_recipe (a larger model: Qwen3-30B-A3B's
    architecture under the tiny student's recipe, its vocabulary aside) adds its weights in the
    trainer's layout, in the trainer's precision; with teacher.offload they stay in host memory."""
    from launch.plan import _memory_rows

    student = REPO / "recipes" / "qwen3_30b_a3b.yaml"
    teacher = ["algo.distill.coef=1.0", "teacher.path=runs/teacher", f"teacher.model_recipe={student}"]
    plain = make_plan(load_recipe(student), paths=False)
    taught = make_plan(load_recipe(student, teacher), paths=False)
    assert taught.teacher == plain.config.model
    assert taught.trainer.teacher == pytest.approx(plain.trainer.weights)  # the same model, frozen
    assert taught.trainer.total == pytest.approx(plain.trainer.total + plain.trainer.weights)
    assert dict(_memory_rows(taught))["  teacher weights"].startswith(
        f"{plain.trainer.weights / 2**30:.2f} GiB"
    )
    offloaded = make_plan(load_recipe(student, [*teacher, "teacher.offload=true"]), paths=False)
    assert offloaded.trainer.teacher == 0
    assert dict(_memory_rows(offloaded))["  teacher weights"].startswith("host memory between passes")


def test_a_lora_run_is_shown_the_fewest_trainer_nodes_that_hold_it():
    """DeepSeek-V3 as shipped trains on 32 nodes; with LoRA 4 hold it: the frozen bf16 weights over
    32 GPUs and the activation estimate, 47.9 GiB of 80, where 2 nodes would need more than 80. A
    full-weight run gets no such row."""
    from launch.plan import _memory_rows, lora_layout
    from moe_rl.planner.memory import trainer_memory

    lora = load_recipe(
        REPO / "recipes" / "deepseek_v3.yaml", ["lora.rank=8", "parallel.sequence_parallel=false"]
    )
    counts = count_params(lora.model)
    fewer = lora_layout(lora, counts)
    assert fewer.config.cluster.trainer_nodes == 4 and fewer.config.parallel.trainer_world_size == 32
    assert fewer.config.parallel.expert_model_parallel_size == 32 and fewer.config.cluster.nodes == 4 + 8
    assert fewer.memory.total <= 80 * GIB
    two = dataclasses.replace(
        fewer.config,
        cluster=dataclasses.replace(fewer.config.cluster, nodes=10, trainer_nodes=2),
        parallel=dataclasses.replace(
            fewer.config.parallel, trainer_world_size=16, expert_model_parallel_size=16
        ),
    )
    assert trainer_memory(two, counts).total > 80 * GIB
    row = dict(_memory_rows(make_plan(lora, paths=False)))["LoRA: fewest trainer nodes"]
    assert row.startswith("4 of 32: ") and "parallel.expert_model_parallel_size=32" in row
    assert lora_layout(load_recipe(REPO / "recipes" / "deepseek_v3.yaml"), counts) is None


@pytest.mark.parametrize(
    ("overrides", "reads"),
    [
        ([], False),  # synthetic prompts, the task's own checker
        (["data.task=file:prompts.jsonl"], True),
        (["data.reward=mod:fn"], True),
        (["data.trajectories=shards"], True),
        (["env.name=calculator"], True),
    ],
)
def test_the_run_reads_what_a_user_gave_for_each_kind_of_input(overrides, reads):
    from moe_rl.config import load_recipe
    from moe_rl.orchestration.preflight import reads_user_inputs

    assert reads_user_inputs(load_recipe(REPO / "recipes" / "tiny_moe.yaml", overrides)) is reads


def test_the_inputs_rule_says_every_prompt_of_a_dataset_file_was_read(tmp_path):
    """A dataset file's prompts are tokenized and measured before the run (the byte tokenizer of a
    model without one), and the preflight's line says so."""
    from moe_rl.config import load_recipe
    from moe_rl.orchestration.preflight import _read_rule

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    config = load_recipe(
        REPO / "recipes" / "tiny_moe.yaml",
        [f"data.task=file:{data}", "model.vocab_size=320", "data.reward=exact_match"],
    )
    rule, inputs = _read_rule(config)
    assert (
        rule.ok
        and rule.values
        == f"every prompt of file:{data} within data.max_prompt_len={config.data.max_prompt_len}"
    )
    assert [ids for ids, _ in inputs.prompt_source.records] == [
        tuple(inputs.prompt_source.tokenizer.encode_prompt(text, None)) for text in ("1+1=", "2+2=")
    ]
