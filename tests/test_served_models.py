"""Several base models on one server (:mod:`ringtune.worker.served_models`, :mod:`ringtune.worker.model_set`):
through the real SDK against one in-process gateway over a :class:`LocalBackend` of two tiny models of different
architectures (a Qwen3.5 hybrid "student" and a Llama "teacher", with different vocabularies), and the
command line's parsing and start-up refusal of a model set that does not fit."""

from __future__ import annotations

import json

import pytest
import tinker
from gateway_fixtures import API_KEY, MAX_TOKENS_PER_RANK, tiny_model_dir
from support.tiny_models import hf_model

from ringtune.cli import main
from ringtune.errors import UserInputError
from ringtune.gateway.config import GatewayConfig
from ringtune.gateway.server import ServerThread
from ringtune.worker.local import LocalBackend
from ringtune.worker.model_set import check_set_fits, parse_live_runs, parse_model_args

STUDENT, TEACHER = "student", "teacher"
TEACHER_VOCAB = 80


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-models")
    student = tiny_model_dir(root / "student")
    teacher = root / "teacher"
    hf_model("llama", seed=1, vocab_size=TEACHER_VOCAB).save_pretrained(teacher)
    backend = LocalBackend(
        str(student), max_tokens_per_rank=MAX_TOKENS_PER_RANK, model_name=STUDENT, more_models=[(TEACHER, str(teacher))]
    )
    config = GatewayConfig(
        checkpoint_root=str(root / "checkpoints"),
        api_key=API_KEY,
        poll_timeout_s=5.0,
        model_live_runs=((TEACHER, 1),),
    )
    server = ServerThread(backend, config)
    server.start()
    yield {"server": server, "teacher_dir": str(teacher), "student_dir": str(student)}
    server.stop()


def datum(tokens: list[int]) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def test_capabilities_list_every_model_and_alias(gateway):
    caps = tinker.RestClient(base_url=gateway["server"].url, api_key=API_KEY).get_server_capabilities().result()
    names = [m.model_name for m in caps.supported_models]
    assert names == [STUDENT, gateway["student_dir"], TEACHER, gateway["teacher_dir"]]


def test_runs_and_samplers_go_to_their_model(gateway):
    with tinker.ServiceClient(base_url=gateway["server"].url, api_key=API_KEY) as sc:
        teacher_run = sc.create_lora_training_client(gateway["teacher_dir"], rank=2).result()  # by its alias
        info = teacher_run.get_info()
        assert info.model_data.arch == "llama" and info.model_name == gateway["teacher_dir"]
        out = teacher_run.forward_backward([datum([1, 5, 79, 3])], "cross_entropy").result()
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 3
        # a token of the teacher's vocabulary outside the student's (96) and inside the teacher's (80) and back
        student_run = sc.create_lora_training_client(STUDENT, rank=2).result()
        assert student_run.get_info().model_data.arch == "qwen3_5_text"
        student_run.forward_backward([datum([1, 95, 3])], "cross_entropy").result()
        with pytest.raises(Exception, match="vocab"):
            teacher_run.forward_backward([datum([1, 95, 3])], "cross_entropy").result()
        teacher = sc.create_sampling_client(base_model=TEACHER).result()
        params = tinker.SamplingParams(max_tokens=3, temperature=1.0, seed=3)
        sampled = teacher.sample(tinker.ModelInput.from_ints([1, 2]), 4, params).result()
        assert all(0 <= t < TEACHER_VOCAB for s in sampled.sequences for t in s.tokens)
        with pytest.raises(Exception, match="vocab"):  # the teacher's vocabulary, not the student's
            teacher.compute_logprobs(tinker.ModelInput.from_ints([1, 90])).result()
        # the teacher run trained on the teacher's weights (its LoRA B = 0: the base), and the two bases differ
        on_teacher = teacher.compute_logprobs(tinker.ModelInput.from_ints([1, 5, 79, 3])).result()[1:]
        assert on_teacher == pytest.approx(out.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-4)
        student = sc.create_sampling_client(base_model=gateway["student_dir"]).result()
        on_student = student.compute_logprobs(tinker.ModelInput.from_ints([1, 5, 79, 3])).result()[1:]
        assert max(abs(a - b) for a, b in zip(on_teacher, on_student, strict=True)) > 1e-2
        # the teacher's budget (model_live_runs=1) is its own: beside its LoRA run a full run of it does not fit,
        # while the student (--max-live-runs 4 of its own size) still admits one
        with pytest.raises(Exception, match="max_live_runs"):
            sc.create_lora_training_client(TEACHER, rank=0).result()
        sc.create_lora_training_client(STUDENT, rank=0).result()
        with pytest.raises(Exception, match="not served here"):
            sc.create_lora_training_client("nobody", rank=2).result()
        executors = gateway["server"].backend.executor.executors
        assert set(executors[TEACHER].trainers) == {info.model_id}
        assert len(executors[STUDENT].trainers) == 2


def test_model_arguments_parse_names_budgets_and_refusals(tmp_path):
    models = parse_model_args(["a=/m/a", str(tmp_path), "smollm2-135m"], "smollm2-135m")
    assert [(m.name, m.source) for m in models] == [("a", "/m/a"), (None, str(tmp_path)), (None, "smollm2-135m")]
    assert [m.source for m in parse_model_args(None, "smollm2-135m")] == ["smollm2-135m"]
    with pytest.raises(UserInputError, match="given twice"):
        parse_model_args(["x=/a", "x=/b"], "d")
    assert parse_live_runs(["b=0"], ["a", "b"], 4) == {"a": 4, "b": 0}
    with pytest.raises(UserInputError, match="NAME one of"):
        parse_live_runs(["c=1"], ["a", "b"], 4)
    check_set_fits({"a": 100, "b": 50}, {"a": 1, "b": 0}, 4, memory=5 * 100 * 4 + 50 * 4)
    with pytest.raises(UserInputError, match=r"model set \['a', 'b'\] does not fit"):
        check_set_fits({"a": 100, "b": 50}, {"a": 1, "b": 0}, 4, memory=5 * 100 * 4 + 50 * 4 - 1)


def test_serve_refuses_a_set_that_does_not_fit_before_loading(tmp_path, capsys):
    argv = ["serve", "--model", "big=smollm2-135m", "--model", "also=smollm2-135m", "--memory-per-rank", "1GiB"]
    argv += ["--checkpoint-root", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    print(err)
    assert "the model set ['big', 'also'] does not fit" in err and "--model-live-runs" in err
    assert main(["serve", "--model", "x=a", "--model-name", "y", "--checkpoint-root", str(tmp_path)]) == 2
    assert "--model-name" in capsys.readouterr().err


def test_plan_sums_the_models_state_and_takes_the_largest_step(capsys):
    base = ["plan", "--context-length", "65536", "--gpus", "8", "--gpu-memory", "80GiB", "--json"]
    one = {m: json.loads(_run(capsys, [*base, "--model", m])) for m in ("Qwen3.5-27B", "Qwen3.5-4B")}
    both = json.loads(_run(capsys, [*base, "--model", "Qwen3.5-27B", "--model", "Qwen3.5-4B"]))
    assert both["model"] == "Qwen3.5-27B + Qwen3.5-4B"
    key = lambda e: (e["layout"]["cp"], e["layout"]["dp"], e["layout"]["shard"], e["layout"]["recompute"],  # noqa: E731
                     e["layout"]["precision"], e["layout"]["ep"])  # fmt: skip
    big, small = ({key(e): e for e in one[m]["layouts"]} for m in ("Qwen3.5-27B", "Qwen3.5-4B"))
    for e in both["layouts"]:
        b, s = big[key(e)], small[key(e)]
        assert e["parameters"] == b["parameters"] + s["parameters"]
        assert e["moments"] == b["moments"] + s["moments"]
        assert e["activations"] == max(b["activations"], s["activations"])


def _run(capsys, argv: list[str]) -> str:
    main(argv)
    return capsys.readouterr().out
