"""--make-vocab-size-divisible-by, --attention-dropout/--hidden-dropout and --distributed-timeout-minutes."""

import datetime

import pytest
import torch

from megatron_lc import parallel_state
from megatron_lc.errors import ConfigError
from megatron_lc.arguments import parse_config
from megatron_lc.training import startup
from megatron_lc.training.trainer import build_run, train_one_step
from tests.helpers import train_flags

BASE = train_flags("--train-iters", "1", tiny_model=True)


def test_vocabulary_is_padded_to_the_multiple_with_rows_no_token_uses():
    run = build_run(parse_config(BASE + ["--vocab-size", "1000", "--make-vocab-size-divisible-by", "128",
                                         "--untie-embeddings-and-output-weights"]))
    assert run.model.config.vocab_size == 1024
    assert run.model.embed_tokens.weight.shape[0] == 1024 and run.model.head.lm_head.weight.shape[0] == 1024
    batch = next(run.loader)
    assert int(batch.input_ids.max()) < 1000 and int(batch.labels.max()) < 1000  # the data's ids: the real ones
    train_one_step(run, 1)
    assert build_run(parse_config(BASE + ["--vocab-size", "1024", "--make-vocab-size-divisible-by", "128"]
                                  )).model.config.vocab_size == 1024  # a multiple already: unchanged


def test_default_leaves_the_vocabulary_as_it_is():
    assert build_run(parse_config(BASE + ["--vocab-size", "1000"])).model.config.vocab_size == 1000


@pytest.mark.parametrize("flag", ["--attention-dropout", "--hidden-dropout"])
def test_dropout_other_than_zero_is_refused_in_one_line(flag):
    parse_config(BASE + [flag, "0"]).validate(world_size=1)
    with pytest.raises(ConfigError, match=rf"^{flag} 0.1: training here is without dropout, as LLaMA"):
        parse_config(BASE + [flag, "0.1"]).validate(world_size=1)


def test_distributed_timeout_reaches_init_process_group(monkeypatch):
    seen = {}
    monkeypatch.setattr(parallel_state.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state.dist, "init_process_group", lambda **kw: seen.update(kw))
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    parallel_state.init_distributed(torch.device("cpu"), env=env, timeout_minutes=3)
    assert seen["timeout"] == datetime.timedelta(minutes=3)

    asked = []
    real = startup.init_distributed
    monkeypatch.setattr(startup, "init_distributed", lambda device, **kw: asked.append(kw) or real(device, **kw))
    build_run(parse_config(BASE + ["--distributed-timeout-minutes", "7"]))
    assert asked == [{"timeout_minutes": 7}]
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes 0 must be > 0"):
        parse_config(BASE + ["--distributed-timeout-minutes", "0"]).validate(world_size=1)
