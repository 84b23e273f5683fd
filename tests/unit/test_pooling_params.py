"""PoolingParams, PoolerConfig from sentence-transformers folders and --pooler-config, runner resolution, and the
scheduler's pooling requests (finished with their pooled result; an encoder's prompts never chunked)."""

from __future__ import annotations

import json

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.engine.protocol import FinishReason, PooledData
from pagedllm.model.registry import resolve_runner
from pagedllm.pooling_params import PoolerConfig, PoolingParams, parse_pooler_override, pooler_config_for
from pagedllm.sampling_params import SamplingParams


def test_pooling_params_validation() -> None:
    with pytest.raises(ValueError, match="task must be one of"):
        PoolingParams(task="generate")
    with pytest.raises(ValueError, match="Dimensions must be greater than 0"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="normalize must be true or false"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]


def test_verify_fills_defaults_and_refuses_other_tasks_parameters() -> None:
    pooler = PoolerConfig(pooling_type="MEAN", normalize=True, use_activation=True)
    embed = PoolingParams().verify("embed", pooler)
    assert (embed.task, embed.normalize, embed.use_activation) == ("embed", True, None)
    assert PoolingParams(normalize=False).verify("embed", pooler).normalize is False
    assert PoolingParams().verify("score", pooler).use_activation is True
    assert PoolingParams(softmax=False).verify("classify", pooler).use_activation is False  # the older name
    with pytest.raises(ValueError, match=r"Task embed only supports \['dimensions', 'normalize'\]"):
        PoolingParams(use_activation=False).verify("embed", pooler)
    with pytest.raises(ValueError, match="Task classify only supports"):
        PoolingParams(normalize=True).verify("classify", pooler)
    with pytest.raises(ValueError, match="cannot overwrite"):
        PoolingParams(task="embed").verify("classify", pooler)
    with pytest.raises(ValueError, match="does not support matryoshka"):
        PoolingParams(dimensions=8).verify("embed", pooler, "m")
    matryoshka = PoolerConfig(matryoshka_dimensions=(64, 128))
    assert PoolingParams(dimensions=64).verify("embed", matryoshka).dimensions == 64
    with pytest.raises(ValueError, match=r"only supports \(64, 128\)"):
        PoolingParams(dimensions=32).verify("embed", matryoshka)


def _st_folder(tmp_path, pooling: dict, normalize: bool = True) -> str:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    base = {
        "word_embedding_dimension": 384,
        "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
    }
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({**base, **pooling}))
    return str(tmp_path)


def test_sentence_transformers_pooling_configs(tmp_path) -> None:
    folder = _st_folder(tmp_path, {"include_prompt": True, "pooling_mode_mean_tokens": True})
    config = pooler_config_for(folder, "CLS")
    assert (config.pooling_type, config.normalize) == ("MEAN", True)  # include_prompt is not a mode
    folder = _st_folder(tmp_path, {"pooling_mode_lasttoken": True}, normalize=False)
    assert (pooler_config_for(folder, "CLS").pooling_type, pooler_config_for(folder, "CLS").normalize) == (
        "LAST",
        False,
    )
    overridden = pooler_config_for(folder, "CLS", '{"pooling_type": "cls", "normalize": true}')
    assert (overridden.pooling_type, overridden.normalize, overridden.source) == ("CLS", True, "--pooler-config")
    folder = _st_folder(tmp_path, {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling mode max_tokens is not supported"):
        pooler_config_for(folder, "CLS")
    assert pooler_config_for(str(tmp_path / "nothing"), "LAST").pooling_type == "LAST"  # no folder: the default


def test_pooler_override_errors() -> None:
    with pytest.raises(ValueError, match="must be a JSON object"):
        parse_pooler_override("MEAN")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        parse_pooler_override({"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="unknown key 'dimensions'"):
        parse_pooler_override({"dimensions": 3})
    assert parse_pooler_override({"softmax": False}) == {"use_activation": False}


def test_resolve_runner() -> None:
    assert resolve_runner("LlamaForCausalLM") == ("generate", None, "LlamaForCausalLM")
    assert resolve_runner("BertModel") == ("pooling", "embed", "BertModel")
    assert resolve_runner("LlamaForCausalLM", "pooling") == ("pooling", "embed", "LlamaForCausalLM")
    assert resolve_runner("Qwen3ForCausalLM", convert="embed") == ("pooling", "embed", "Qwen3ForCausalLM")
    assert resolve_runner("Qwen3ForCausalLM", convert="classify") == (
        "pooling",
        "classify",
        "Qwen3ForSequenceClassification",
    )
    with pytest.raises(ValueError, match="cannot generate"):
        resolve_runner("BertForSequenceClassification", "generate")
    with pytest.raises(ValueError, match="needs --runner pooling"):
        resolve_runner("LlamaForCausalLM", "generate", "embed")
    with pytest.raises(ValueError, match="--convert classify is not supported for GemmaForCausalLM"):
        resolve_runner("GemmaForCausalLM", convert="classify")
    with pytest.raises(ValueError, match="runner must be one of"):
        resolve_runner("BertModel", "encode")


def _pooling_request(rid: str, n: int, call_tokens: int | None = None, arrival: float = 0.0) -> Request:
    params = PoolingParams(task="embed", call_tokens=call_tokens)
    ids = list(range(5, 5 + n))
    return Request(rid, ids, SamplingParams(max_tokens=1), None, pooling_params=params, arrival_time=arrival)


def test_scheduler_runs_encoder_prompts_whole_and_finishes_them_with_their_result() -> None:
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, max_model_len=100, chunked_prefill=False),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        64,
    )
    for rid, n in (("a", 60), ("b", 60), ("c", 30)):
        sched.add_request(_pooling_request(rid, n))
    out = sched.schedule()
    # "b" does not fit whole beside "a": it waits (FCFS: "c" waits behind it), nothing is chunked
    assert out.num_scheduled_tokens == {"a": 60}
    assert out.scheduled_new_reqs[0].pooling_params.task == "embed"
    pooled = PooledData(b"\x00" * 8, [2])
    result = sched.update_from_output(out, ModelRunnerOutput(["a"], [[]], pooler_output={"a": pooled}))
    (only,) = result.outputs
    assert only.pooling_output == pooled and only.finish_reason == FinishReason.STOP and only.new_token_ids == []
    assert "a" not in sched.requests and sched.kv_cache_manager.num_blocks_in_use() == 0
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 60, "c": 30} and out.finished_req_ids == {"a"}
    # a pooling request whose result did not come (aborted while running) is freed like any other
    sched.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.num_blocks_in_use() == 0 and not sched.has_unfinished_requests()


def _encoder_scheduler(max_seqs: int, express: int, chunked: bool = False) -> Scheduler:
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=100, max_num_seqs=max_seqs, max_model_len=100, chunked_prefill=chunked,
            policy="shortest",
        ),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        64,
    )  # fmt: skip
    assert sched.enable_express(express) != chunked  # a model whose prompts run in chunks has no lane
    return sched


def test_express_steps_take_only_the_waiting_requests_of_short_calls() -> None:
    sched = _encoder_scheduler(max_seqs=4, express=32)
    sched.add_request(_pooling_request("doc", 90, call_tokens=900))
    out = sched.schedule()  # the step "in flight"
    assert out.num_scheduled_tokens == {"doc": 90}
    assert sched.schedule_express() is None  # nothing waiting
    # Arrivals during that step: a query of a short call, documents of a long one (one of them shorter than the
    # query), a request without a call size (offline), a second query, and a third that no longer fits.
    arrivals = [
        ("q1", 10, 10, 1.0),
        ("d1", 5, 400, 2.0),
        ("off", 6, None, 3.0),
        ("q2", 12, 12, 4.0),
        ("q3", 11, 30, 5.0),
    ]
    for rid, n, call, arrival in arrivals:
        sched.add_request(_pooling_request(rid, n, call, arrival))
    express = sched.schedule_express()
    assert express is not None
    # By arrival, short calls only, as far as 32 tokens: q1 and q2; q3 does not fit beside them
    assert express.num_scheduled_tokens == {"q1": 10, "q2": 12}
    assert express.total_num_scheduled_tokens == 22
    assert [r.req_id for r in express.scheduled_new_reqs] == ["q1", "q2"]
    assert express.finished_req_ids == set()
    pooled = PooledData(b"\x00" * 8, [2])
    done = sched.update_from_output(
        express, ModelRunnerOutput(["q1", "q2"], [[], []], pooler_output={"q1": pooled, "q2": pooled})
    )
    assert sorted(o.request_id for o in done.outputs) == ["q1", "q2"]
    assert done.scheduler_stats.num_scheduled_tokens == 22
    # The next express step, in the same step in flight, tells the worker that q1 and q2 are done: their rows are
    # free again (the worker has max_num_seqs rows, the step in flight holds some)
    again = sched.schedule_express()
    assert again is not None and again.num_scheduled_tokens == {"q3": 11}
    assert again.finished_req_ids == {"q1", "q2"}
    sched.update_from_output(again, ModelRunnerOutput(["q3"], [[]], pooler_output={"q3": pooled}))
    assert sched.schedule_express() is None  # only the long call's document and the offline request are left
    # The step in flight finishes as it would have; the next regular step tells the worker of the rest
    sched.update_from_output(out, ModelRunnerOutput(["doc"], [[]], pooler_output={"doc": pooled}))
    nxt = sched.schedule()
    assert nxt.num_scheduled_tokens == {"d1": 5, "off": 6}
    assert nxt.finished_req_ids == {"doc", "q3"}


def test_express_steps_respect_max_num_seqs_priority_and_chunked_prefill() -> None:
    sched = _encoder_scheduler(max_seqs=2, express=64)
    sched.add_request(_pooling_request("doc", 50, call_tokens=500))
    sched.schedule()
    for rid in ("q1", "q2"):
        sched.add_request(_pooling_request(rid, 5, call_tokens=5))
    express = sched.schedule_express()
    assert express is not None and express.num_scheduled_tokens == {"q1": 5}  # doc + q1 = max_num_seqs
    # A waiting request admitted by a regular step, or aborted, leaves the lane
    sched = _encoder_scheduler(max_seqs=8, express=64)
    for rid, priority in (("late", 0), ("urgent", -1), ("gone", -2)):
        r = _pooling_request(rid, 5, call_tokens=5, arrival=1.0 if rid == "late" else 2.0)
        r.priority = priority
        sched.add_request(r)
    sched.finish_requests(["gone"], RequestStatus.FINISHED_ABORTED)
    assert "gone" not in sched._express_waiting  # a finished request is not kept for the lane
    express = sched.schedule_express()
    assert express is not None and list(express.num_scheduled_tokens) == ["urgent", "late"]  # priority, then arrival
    sched.add_request(_pooling_request("q", 5, call_tokens=5))
    assert sched.schedule().num_scheduled_tokens == {"q": 5}
    assert sched.schedule_express() is None
    # A model whose prompts run in chunks (a decoder) has no express lane
    sched = _encoder_scheduler(max_seqs=8, express=64, chunked=True)
    sched.add_request(_pooling_request("q", 5, call_tokens=5))
    assert sched.schedule_express() is None


def test_no_lane_until_enabled() -> None:
    """A scheduler whose engine has no express lane (a worker in another process) keeps nothing for it."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8, max_model_len=100, chunked_prefill=False),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        64,
    )
    sched.add_request(_pooling_request("q", 5, call_tokens=5))
    assert not sched._express_waiting and sched.schedule_express() is None
    assert sched.schedule().num_scheduled_tokens == {"q": 5}
