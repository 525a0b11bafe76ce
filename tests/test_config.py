from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from grpo_server.config import (ExperimentConfig, ServerConfig, keys_as_saved, load_experiment_config,
                                load_server_config)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_name_alone_is_a_valid_experiment():
    config = ExperimentConfig(name="x")
    assert config.lora.r == 16 and config.lora.alpha == 32
    # grpo's clip is symmetric 0.2 (DeepSeekMath); clip-higher 0.28 is dapo's (tests/test_algorithm_defaults.py)
    assert config.algorithm.loss == "grpo" and (config.algorithm.clip_low, config.algorithm.clip_high) == (0.2, 0.2)
    assert config.sampling.n == 8
    assert "gate_proj" in config.lora.target_modules


@pytest.mark.parametrize("data, where", [
    ({"name": "x", "bogus": 1}, "bogus"),
    ({"name": "x", "lora": {"rank": 4}}, "lora.rank"),
    ({"name": "x", "algorithm": {"loss": "ppo"}}, "algorithm.loss"),
    ({"name": "Upper"}, "name"),
    ({"name": "x" * 65}, "name"),
    ({"name": "x", "sampling": {"n": 0}}, "sampling.n"),
])
def test_experiment_config_is_strict_and_names_the_key(data, where):
    with pytest.raises(ValidationError) as info:
        ExperimentConfig.model_validate(data)
    locations = {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}
    assert where in locations


def test_api_key_is_never_shown():
    config = ExperimentConfig(name="x", api_key="secret-value-0123")
    assert "secret-value-0123" not in str(config.public_dict())
    assert config.public_dict()["has_api_key"] is True


def test_api_key_has_a_minimum_length_but_saved_ones_load():
    with pytest.raises(ValidationError, match="at least 16 characters") as info:
        ExperimentConfig(name="x", api_key="k" * 15)
    assert info.value.errors()[0]["loc"] == ("api_key",)
    assert ExperimentConfig(name="x", api_key="k" * 16).api_key.get_secret_value() == "k" * 16
    assert ExperimentConfig.model_json_schema()["properties"]["api_key"]["anyOf"][0]["minLength"] == 16
    with keys_as_saved():  # the registry of a run from before the rule: its experiments come back
        assert ExperimentConfig(name="x", api_key="short").api_key.get_secret_value() == "short"
    with pytest.raises(ValidationError):  # and the rule holds again after
        ExperimentConfig(name="x", api_key="short")


def test_auth_limit_settings():
    config = ServerConfig(auth_limit_exempt=["127.0.0.1", "10.0.0.0/8", "::1"])
    assert (config.auth_failure_limit, config.auth_failure_window_s) == (10, 60.0)
    with pytest.raises(ValidationError, match="auth_limit_exempt"):
        ServerConfig(auth_limit_exempt=["not-an-address"])


def test_combinations_that_cannot_work_are_refused_at_load():
    """Each used to pass the config and fail later: vLLM refused the rank at the sampler's start (after the model had
    loaded), and an inline experiment over the rank was refused at its create and held as failed."""
    with pytest.raises(ValidationError, match="max_lora_rank 12 is not one vLLM takes"):
        ServerConfig(sampler={"max_lora_rank": 12})
    assert ServerConfig(sampler={"engine": "transformers", "max_lora_rank": 12}).sampler.max_lora_rank == 12
    with pytest.raises(ValidationError, match="'big' has lora.r 32, over sampler.max_lora_rank 16"):
        ServerConfig(experiments=[{"name": "big", "lora": {"r": 32}}])
    assert ServerConfig(sampler={"max_lora_rank": 32}, experiments=[{"name": "big", "lora": {"r": 32}}])


def test_shipped_configs_validate():
    for path in CONFIGS.glob("*.yaml"):
        if path.name == "server.yaml":
            load_server_config(path)
        else:
            load_experiment_config(path)


def test_server_config_strict_and_env(monkeypatch, tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"port": 9, "sampler": {"replicas": 2, "typo": 1}}))
    with pytest.raises(ValidationError, match="sampler.typo"):
        load_server_config(path)
    monkeypatch.setenv("GRPO_SERVER_API_KEY", "from-env-0123456789")
    assert ServerConfig().api_key.get_secret_value() == "from-env-0123456789"
    monkeypatch.setenv("GRPO_SERVER_API_KEY", "too-short")  # an admin key is at least MIN_KEY_LENGTH characters
    with pytest.raises(ValidationError, match="api_key"):
        ServerConfig()


def test_server_config_loads_experiment_files(tmp_path):
    config = load_server_config(None, experiments=[str(CONFIGS / "alphabetize.yaml")])
    assert config.experiments[0].name == "alphabetize"


def test_environment_over_file_and_flags_over_both(monkeypatch, tmp_path):
    """README "Configuration": the CLI's flags > GRPO_SERVER_* > the YAML file > the defaults."""
    for name in ("GRPO_SERVER_MAX_N", "GRPO_SERVER_MAX_TOKENS", "GRPO_SERVER_SAMPLER"):
        monkeypatch.delenv(name, raising=False)  # the values this test reads come from where it says
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"port": 9001, "max_n": 7, "sampler": {"replicas": 2, "max_loras": 3}}))
    monkeypatch.setenv("GRPO_SERVER_PORT", "9002")
    monkeypatch.setenv("GRPO_SERVER_SAMPLER__REPLICAS", "5")  # one nested key; the file's others stay
    config = load_server_config(path)
    assert config.port == 9002 and (config.sampler.replicas, config.sampler.max_loras) == (5, 3)
    assert config.max_n == 7  # only in the file: the file's value
    assert config.max_tokens == ServerConfig.model_fields["max_tokens"].default  # in neither: the default
    # A flag (an init argument) beats both; a flag not given (None) leaves them be.
    assert load_server_config(path, port=9003, host=None).port == 9003
    monkeypatch.delenv("GRPO_SERVER_SAMPLER__REPLICAS")
    monkeypatch.setenv("GRPO_SERVER_SAMPLER", '{"replicas": 4}')  # a whole section as JSON merges the same way
    config = load_server_config(path)
    assert (config.sampler.replicas, config.sampler.max_loras) == (4, 3)


def test_config_file_errors_name_the_file(monkeypatch, tmp_path):
    monkeypatch.delenv("GRPO_SERVER_PORT", raising=False)
    with pytest.raises(FileNotFoundError, match="missing.yaml"):  # never a server started on the defaults
        load_server_config(tmp_path / "missing.yaml")
    for text, message in [("- a list\n", "expected a mapping"), ("port: [\n", "not valid YAML")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ValueError, match=message) as info:
            load_server_config(path)
        assert "bad.yaml" in str(info.value)
    (tmp_path / "empty.yaml").write_text("")
    assert load_server_config(tmp_path / "empty.yaml").port == 8000


def test_unknown_environment_keys_are_errors(monkeypatch):
    monkeypatch.setenv("GRPO_SERVER_SAMPLER__TYPO", "1")
    with pytest.raises(ValidationError, match="sampler.typo"):
        load_server_config(None)
