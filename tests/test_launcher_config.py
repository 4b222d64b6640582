"""The `launch:` section and the argv/environment built for each instance: no subprocess here."""

from __future__ import annotations

import re
import sys

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config.fields import Problems, Section
from gateway.config.launch import LaunchGroup, flag_name, read_launch
from gateway.launcher.spawn import (
    SIM_DEFAULT_MAX_BATCH_SIZE,
    LaunchError,
    instance_env,
    launched_slots,
    lmdeploy_argv,
    plan_group,
    probe_devices,
    redact,
    sim_argv,
)

pytestmark = pytest.mark.unit

KEY = "internal-key-for-tests"


def read(launch, env=None):
    problems = Problems()
    groups = read_launch(Section({"launch": launch}, "", problems), env=env or {})
    return groups, problems.items


def one(**fields) -> LaunchGroup:
    groups, problems = read({"model": "internlm/internlm2_5-7b-chat", **fields})
    assert problems == []
    return groups[0]


# -- accepted configs ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, expect",
    [
        ({}, {"engine": "auto", "gpus": "all", "tp": 1, "backend": "turbomind", "device": "cuda", "served_name": "internlm/internlm2_5-7b-chat"}),
        ({"model_name": "chat", "engine": " SIM "}, {"engine": "sim", "served_name": "chat"}),
        ({"gpus": [0, 1, 2, 3], "tp": 2}, {"gpus": (0, 1, 2, 3), "tp": 2}),
        ({"gpus": "0,1"}, {"gpus": (0, 1)}),
        ({"gpus": 4, "tp": 4}, {"gpus": 4}),
        ({"gpus": "ALL"}, {"gpus": "all"}),
        ({"device": "ascend"}, {"backend": "pytorch", "device": "ascend"}),  # TurboMind is CUDA-only: default follows
        ({"backend": "PyTorch", "device": "maca"}, {"backend": "pytorch", "device": "maca"}),
        ({"quant_policy": "int8"}, {"quant_policy": 8}),
        ({"quant_policy": 4}, {"quant_policy": 4}),
        ({"quant_policy": "fp8", "backend": "pytorch"}, {"quant_policy": 16}),
        ({"cache_max_entry_count": 0.5, "session_len": 8192, "max_batch_size": 64}, {"cache_max_entry_count": 0.5}),
        ({"extra_args": ["--max-concurrent-requests", "64", "--trust-remote-code"]}, {"extra_args": ("--max-concurrent-requests", "64", "--trust-remote-code")}),
        ({"env": {"HF_HOME": "/data/hf", "LMDEPLOY_USE_MODELSCOPE": True}}, {"env": (("HF_HOME", "/data/hf"), ("LMDEPLOY_USE_MODELSCOPE", "true"))}),
        ({"engine": "sim", "instances": 3, "sim": {"startup_delay": 2, "ttft": 0.1}}, {"instances": 3, "sim": (("startup_delay", 2.0), ("ttft", 0.1))}),
        ({"eager_mode": True, "backend": "pytorch"}, {"eager_mode": True}),
    ],
)
def test_accepted_launch_groups(fields, expect):
    g = one(**fields)
    for name, value in expect.items():
        assert getattr(g, name) == value, name


def test_a_single_mapping_and_a_list_both_work_and_several_groups_serve_different_models():
    groups, problems = read([{"model": "a", "engine": "sim"}, {"model": "b", "engine": "sim", "model_name": "bee"}])
    assert problems == []
    assert [g.served_name for g in groups] == ["a", "bee"]
    assert [g.index for g in groups] == [0, 1]


# -- refused configs -------------------------------------------------------------------------------------
REFUSED = [
    ({"backend": "vlm"}, "launch[0].backend: 'vlm' is not a valid choice; choose one of: turbomind, pytorch"),
    ({"engine": "vllm"}, "launch[0].engine: 'vllm' is not a valid choice; choose one of: auto, lmdeploy, sim"),
    ({"device": "rocm"}, "launch[0].device: 'rocm' is not a valid choice; choose one of: cuda, ascend, maca, camb"),
    ({"backend": "turbomind", "device": "ascend"}, "launch[0].backend: turbomind runs only on CUDA GPUs, but device is 'ascend'; use backend: pytorch"),
    ({"quant_policy": "fp8"}, "launch[0].quant_policy: 'fp8' is a PyTorch-engine option: TurboMind has no FP8 KV cache"),
    ({"quant_policy": 17, "backend": "turbomind"}, "TurboMind has no FP8 KV cache"),
    ({"quant_policy": "int8", "device": "camb"}, "launch[0].quant_policy: KV cache quantization works only on cuda and ascend"),
    ({"quant_policy": "int3"}, "launch[0].quant_policy: 'int3' is not a valid choice"),
    ({"eager_mode": True}, "launch[0].eager_mode: is a PyTorch-engine option"),
    ({"extra_args": ["--adapters", "a=/lora"]}, "'--adapters' is a PyTorch-engine option that TurboMind does not have"),
    ({"backend": "pytorch", "extra_args": ["--communicator", "nccl"]}, "'--communicator' is a TurboMind option"),
    ({"cache_max_entry_count": 1}, "launch[0].cache_max_entry_count: 1 is out of range; must be > 0 and < 1"),
    ({"cache_max_entry_count": 0}, "launch[0].cache_max_entry_count: 0 is out of range; must be > 0 and < 1"),
    ({"tp": 0}, "launch[0].tp: 0 is out of range"),
    ({"gpus": [0, 1, 2], "tp": 2}, "launch[0].gpus: 3 devices do not split into instances of tp=2; 1 would sit idle"),
    ({"gpus": [0], "tp": 2}, "launch[0].gpus: 1 device(s) listed but tp is 2"),
    ({"gpus": 3, "tp": 2}, "launch[0].gpus: 3 devices do not split into instances of tp=2"),
    ({"gpus": [0, 0]}, "launch[0].gpus[1]: device 0 is listed twice"),
    ({"gpus": [-1]}, "launch[0].gpus[0]: expected a device id"),
    ({"gpus": "some"}, "launch[0].gpus: 'some' is not valid"),
    ({"gpus": 0}, "launch[0].gpus: 0 is out of range"),
    ({"extra_args": ["--server-port", "9"]}, "launch[0].extra_args[0]: '--server-port' is not allowed: the launcher picks"),
    ({"extra_args": ["--allow_terminate_by_client"]}, "'--allow_terminate_by_client' is not allowed: it would let any key holder stop the backend"),
    ({"extra_args": ["--proxy-url=http://x"]}, "'--proxy-url=http://x' is not allowed: the gateway is the proxy"),
    ({"extra_args": ["--api-keys", "k"]}, "is not allowed: the launcher passes an internal key"),
    ({"extra_args": ["--session_len", "9"]}, "set `session_len` instead"),
    ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "launch[0].env.CUDA_VISIBLE_DEVICES: CUDA_VISIBLE_DEVICES is set per instance by the launcher"),
    ({"instances": 2, "engine": "lmdeploy"}, "launch[0].instances: applies to the simulator only"),
    ({"sim": {"ttft": -1}}, "launch[0].sim.ttft: -1 is out of range"),
    ({"sim": {"tpoot": 1}}, "launch[0].sim.tpoot: unknown field (did you mean 'tpot'?)"),
    ({"gpu": 2}, "launch[0].gpu: unknown field (did you mean 'gpus'?)"),
    ({"start_timeout": 0}, "launch[0].start_timeout: 0 is out of range"),
    ({"restart_backoff": 5, "restart_backoff_max": 1}, "launch[0].restart_backoff_max: 1 is less than restart_backoff (5)"),
]


@pytest.mark.parametrize("fields, message", REFUSED, ids=[m[:50] for _, m in REFUSED])
def test_refused_launch_groups_say_why(fields, message):
    groups, problems = read({"model": "m", **fields})
    assert groups == ()
    assert any(message in p for p in problems), problems


def test_model_is_required():
    _, problems = read({"engine": "sim"})
    assert problems == ["launch[0].model: required field is missing"]


def test_every_problem_of_every_group_is_reported_at_once():
    _, problems = read([{"model": "a", "backend": "vlm", "tp": 0}, {"model": "b", "device": "npu"}])
    assert len(problems) == 3
    assert problems[0].startswith("launch[0].tp") or problems[0].startswith("launch[0].backend")
    assert problems[2].startswith("launch[1].device")


@pytest.mark.parametrize(
    "groups, message",
    [
        ([{"model": "a", "gpus": [0, 1]}, {"model": "b", "gpus": [1, 2]}], "launch[1].gpus: device 1 is also used by launch[0]"),
        ([{"model": "a"}, {"model": "b"}], "both launch[0] and launch[1] take cuda devices by count or 'all'"),
        ([{"model": "a", "gpus": 2}, {"model": "b", "gpus": [3]}], "launch[0] takes cuda devices by count or 'all'"),
        ([{"model": "a", "model_name": "x", "engine": "sim"}, {"model": "b", "model_name": "x", "engine": "sim"}], "'x' is already served by launch[0] from a different model"),
    ],
)
def test_groups_must_not_share_devices_or_names(groups, message):
    _, problems = read(groups)
    assert any(message in p for p in problems), problems


def test_groups_on_different_device_types_or_simulated_may_share_ids():
    _, problems = read([{"model": "a", "gpus": [0]}, {"model": "b", "gpus": [0], "device": "ascend"}, {"model": "c", "engine": "sim"}])
    assert problems == []


# -- environment overrides ----------------------------------------------------------------------------------
def test_environment_overrides_apply_to_every_group():
    groups, problems = read([{"model": "a"}, {"model": "b", "gpus": [3]}], env={"LMDEPLOY_GATEWAY_ENGINE": "sim", "LMDEPLOY_GATEWAY_BACKEND": "PyTorch"})
    assert problems == []
    assert [(g.engine, g.backend) for g in groups] == [("sim", "pytorch"), ("sim", "pytorch")]


def test_environment_overrides_are_validated_like_the_fields():
    _, problems = read({"model": "a"}, env={"LMDEPLOY_GATEWAY_BACKEND": "vlm"})
    assert problems == ["environment.LMDEPLOY_GATEWAY_BACKEND: 'vlm' is not a valid choice; choose one of: turbomind, pytorch"]


def test_environment_override_conflicts_name_the_variable():
    _, problems = read({"model": "a", "backend": "turbomind"}, env={"LMDEPLOY_GATEWAY_DEVICE": "ascend"})
    assert problems == [
        "launch[0].backend: turbomind runs only on CUDA GPUs, but LMDEPLOY_GATEWAY_DEVICE (environment) is 'ascend'; use backend: pytorch"
    ]


def test_the_loader_reports_launch_problems_with_the_rest_of_the_config(monkeypatch):
    monkeypatch.delenv("LMDEPLOY_GATEWAY_BACKEND", raising=False)
    with pytest.raises(ConfigError) as err:
        parse_config({"auth": {"disabled": True}, "launch": {"model": "m", "backend": "vlm"}, "server": {"port": -1}})
    text = str(err.value)
    assert "launch[0].backend: 'vlm' is not a valid choice; choose one of: turbomind, pytorch" in text
    assert "server.port" in text


@pytest.mark.parametrize(
    "arg, name",
    [("--session-len", "session-len"), ("--Session_Len=9", "session-len"), ("--hf-overrides.rope.x", "hf-overrides"), ("64", None), ("-1", None), ("--tp", "tp")],
)
def test_flag_names_follow_lmdeploys_flexible_parser(arg, name):
    assert flag_name(arg) == name


# -- engine choice and device sets --------------------------------------------------------------------------
def devices(ids, how="test"):
    return lambda device: (tuple(str(i) for i in ids) if ids is not None else None, how)


LMDEPLOY = lambda: (("/opt/bin/lmdeploy",), "lmdeploy on PATH (/opt/bin/lmdeploy)")  # noqa: E731
NO_LMDEPLOY = lambda: (None, "lmdeploy is not installed")  # noqa: E731


def test_auto_without_lmdeploy_runs_the_simulator_and_says_why():
    plan = plan_group(one(), devices([0, 1]), NO_LMDEPLOY)
    assert (plan.engine, plan.instances) == ("sim", 2)
    assert plan.reason == "lmdeploy is not installed"


def test_auto_without_gpus_runs_the_simulator_and_says_why():
    plan = plan_group(one(instances=3), devices([], "no NVIDIA driver found"), LMDEPLOY)
    assert (plan.engine, plan.instances) == ("sim", 3)
    assert "no cuda device is visible (no NVIDIA driver found)" in plan.reason


def test_auto_with_lmdeploy_and_gpus_runs_one_instance_per_gpu():
    plan = plan_group(one(), devices([0, 1, 2, 3], "nvidia-smi lists 4 GPU(s)"), LMDEPLOY)
    assert plan.engine == "lmdeploy"
    assert plan.device_sets == (("0",), ("1",), ("2",), ("3",))
    assert "4 cuda device(s) visible" in plan.reason


def test_tp2_on_four_gpus_makes_two_instances_on_disjoint_pairs():
    plan = plan_group(one(engine="lmdeploy", tp=2), devices([0, 1, 2, 3]), LMDEPLOY)
    assert plan.device_sets == (("0", "1"), ("2", "3"))


def test_a_gpu_count_takes_the_first_visible_devices():
    plan = plan_group(one(engine="lmdeploy", gpus=2), devices([4, 5, 6]), LMDEPLOY)
    assert plan.device_sets == (("4",), ("5",))


@pytest.mark.parametrize(
    "group, visible, message",
    [
        ({"engine": "lmdeploy"}, [0], None),
        ({"engine": "lmdeploy", "gpus": 4}, [0, 1], "launch[0].gpus: 4 devices asked for, but only 2 are visible"),
        ({"engine": "lmdeploy", "gpus": [0, 7]}, [0, 1], "launch[0].gpus: device(s) 7 are not visible"),
        ({"engine": "lmdeploy", "tp": 2}, [0], "launch[0]: tp is 2 but only 1 cuda device(s) are visible"),
        ({"engine": "lmdeploy", "device": "maca"}, None, "launch[0].gpus: 'all' needs the visible devices"),
    ],
)
def test_machine_mismatches_are_refused_at_start(group, visible, message):
    if message is None:
        plan_group(one(**group), devices(visible), LMDEPLOY)
        return
    with pytest.raises(LaunchError, match=re.escape(message)):
        plan_group(one(**group), devices(visible), LMDEPLOY)


def test_engine_lmdeploy_without_lmdeploy_is_refused_with_the_fix():
    with pytest.raises(LaunchError, match="engine lmdeploy, but lmdeploy is not installed; install it"):
        plan_group(one(engine="lmdeploy"), devices([0]), NO_LMDEPLOY)


def test_device_probe_reads_the_visible_devices_variable():
    assert probe_devices("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"}) == (("2", "3"), "CUDA_VISIBLE_DEVICES='2,3'")
    assert probe_devices("cuda", {"CUDA_VISIBLE_DEVICES": ""})[0] == ()
    assert probe_devices("ascend", {"ASCEND_RT_VISIBLE_DEVICES": "0,1"})[0] == ("0", "1")


# -- exact argv and environment --------------------------------------------------------------------------------
def test_lmdeploy_argv_tp1_on_four_gpus():
    g = one(engine="lmdeploy", model_name="chat", gpus=[0, 1, 2, 3], cache_max_entry_count=0.5, session_len=8192)
    plan = plan_group(g, devices([0, 1, 2, 3]), LMDEPLOY)
    assert plan.instances == 4
    assert lmdeploy_argv(plan, 40001, KEY) == [
        "/opt/bin/lmdeploy", "serve", "api_server", "internlm/internlm2_5-7b-chat",
        "--server-name", "127.0.0.1", "--server-port", "40001",
        "--model-name", "chat", "--backend", "turbomind", "--tp", "1",
        "--cache-max-entry-count", "0.5", "--session-len", "8192",
        "--api-keys", KEY,
    ]  # fmt: skip
    envs = [instance_env(plan, d, {"PATH": "/bin"}) for d in plan.device_sets]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2", "3"]
    assert envs[0] == {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "0"}


def test_lmdeploy_argv_tp2_on_four_gpus_with_every_option():
    g = one(
        engine="lmdeploy",
        tp=2,
        backend="pytorch",
        quant_policy=8,
        max_batch_size=128,
        enable_prefix_caching=True,
        dtype="bfloat16",
        chat_template="/etc/tpl.json",
        eager_mode=True,
        extra_args=["--max-concurrent-requests", "256"],
        env={"HF_HOME": "/data/hf"},
    )
    plan = plan_group(g, devices([0, 1, 2, 3]), LMDEPLOY)
    assert plan.device_sets == (("0", "1"), ("2", "3"))
    assert lmdeploy_argv(plan, 40002, KEY) == [
        "/opt/bin/lmdeploy", "serve", "api_server", "internlm/internlm2_5-7b-chat",
        "--server-name", "127.0.0.1", "--server-port", "40002",
        "--model-name", "internlm/internlm2_5-7b-chat", "--backend", "pytorch", "--tp", "2", "--device", "cuda",
        "--max-batch-size", "128", "--quant-policy", "int8", "--enable-prefix-caching",
        "--dtype", "bfloat16", "--chat-template", "/etc/tpl.json", "--eager-mode",
        "--max-concurrent-requests", "256",
        "--api-keys", KEY,
    ]  # fmt: skip
    env = instance_env(plan, plan.device_sets[1], {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["HF_HOME"] == "/data/hf"


def test_lmdeploy_argv_and_env_on_ascend():
    g = one(engine="lmdeploy", device="ascend", gpus=[0, 1], model_name="chat")
    plan = plan_group(g, devices([0, 1, 2, 3]), LMDEPLOY)
    argv = lmdeploy_argv(plan, 40003, KEY)
    assert argv[argv.index("--backend") + 1] == "pytorch"
    assert argv[argv.index("--device") + 1] == "ascend"
    env = instance_env(plan, plan.device_sets[1], {})
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize("device, var", [("maca", "MACA_VISIBLE_DEVICES"), ("camb", "MLU_VISIBLE_DEVICES")])
def test_other_devices_get_their_own_visibility_variable(device, var):
    plan = plan_group(one(engine="lmdeploy", device=device, gpus=[2]), devices([2]), LMDEPLOY)
    assert instance_env(plan, plan.device_sets[0], {})[var] == "2"


def test_argv_never_asks_for_client_termination_or_a_proxy_and_binds_loopback():
    plan = plan_group(one(engine="lmdeploy"), devices([0]), LMDEPLOY)
    argv = lmdeploy_argv(plan, 40004, KEY)
    assert "--allow-terminate-by-client" not in argv and "--proxy-url" not in argv
    assert argv[argv.index("--server-name") + 1] == "127.0.0.1"
    assert argv[-2:] == ["--api-keys", KEY]


def test_importable_lmdeploy_runs_as_a_module():
    plan = plan_group(one(engine="lmdeploy"), devices([0]), lambda: ((sys.executable, "-m", "lmdeploy"), "lmdeploy importable"))
    assert lmdeploy_argv(plan, 1, KEY)[:5] == [sys.executable, "-m", "lmdeploy", "serve", "api_server"]


def test_sim_argv_passes_the_key_like_lmdeploy_and_the_shared_knobs():
    g = one(engine="sim", model_name="chat", max_batch_size=8, sim={"startup_delay": 1.5, "ttft": 0.01})
    plan = plan_group(g, devices([]), NO_LMDEPLOY)
    assert sim_argv(plan, 40005, KEY) == [
        sys.executable, "-m", "gateway.sim", "--host", "127.0.0.1", "--port", "40005", "--model", "chat",
        "--backend", "turbomind", "--max-batch-size", "8", "--startup-delay", "1.5", "--ttft", "0.01",
        "--api-keys", KEY,
    ]  # fmt: skip
    assert "CUDA_VISIBLE_DEVICES" not in instance_env(plan, (), {})


def test_logged_argv_hides_the_internal_key():
    plan = plan_group(one(engine="lmdeploy"), devices([0]), LMDEPLOY)
    assert KEY not in " ".join(redact(lmdeploy_argv(plan, 1, KEY), KEY))


# -- log files and exit descriptions ------------------------------------------------------------------------------
def test_instance_log_rotates_by_size_and_tails_only_the_current_run(tmp_path):
    from gateway.launcher.process import InstanceLog

    log = InstanceLog(tmp_path / "chat_0.log", max_bytes=200, backups=2)
    log.begin("start 1: lmdeploy serve api_server m --api-keys ***")
    with open(log.path, "a") as f:
        f.write("loading weights\n" * 20)  # 320 bytes: over the limit
    log.begin("start 2")
    assert (tmp_path / "chat_0.log.1").read_text().count("loading weights") == 20
    with open(log.path, "a") as f:
        f.write("Traceback (most recent call last):\nAssertionError: boom\n")
    assert log.tail() == ["Traceback (most recent call last):", "AssertionError: boom"]
    for n in range(3, 6):  # older files shift; only `backups` are kept
        with open(log.path, "a") as f:
            f.write("x" * 300 + "\n")
        log.begin(f"start {n}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat_0.log", "chat_0.log.1", "chat_0.log.2"]
    assert oct(log.path.stat().st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("code, text", [(0, "exited with code 0"), (3, "exited with code 3"), (137, "killed by SIGKILL"), (-15, "killed by SIGTERM")])
def test_exit_statuses_read_as_words(code, text):
    from gateway.launcher.process import describe_exit

    assert describe_exit(code) == text


# -- the batch slots the balancer is told --------------------------------------------------------------
def test_launched_slots_are_the_groups_max_batch_size_or_the_simulators_default():
    assert launched_slots(plan_group(one(max_batch_size=48), devices([0, 1]), NO_LMDEPLOY)) == 48
    assert launched_slots(plan_group(one(max_batch_size=48), devices([0, 1], "nvidia-smi lists 2 GPU(s)"), LMDEPLOY)) == 48
    assert launched_slots(plan_group(one(), devices([0, 1]), NO_LMDEPLOY)) == SIM_DEFAULT_MAX_BATCH_SIZE
    # lmdeploy's own default depends on the device: unknown, left for /metrics to show
    assert launched_slots(plan_group(one(), devices([0, 1], "nvidia-smi lists 2 GPU(s)"), LMDEPLOY)) is None


def test_the_simulators_default_batch_size_is_the_one_the_launcher_assumes():
    from gateway.sim.config import build_parser

    assert build_parser().get_default("max_batch_size") == SIM_DEFAULT_MAX_BATCH_SIZE
