"""Loading Hugging Face folders (single file, sharded, bf16), saving them back, and the errors for
bad input. transformers (torch, fp32) is the oracle for logits and tokenizer behaviour."""

from __future__ import annotations

import json
import os
import shutil
import stat

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from starpo_jax.models.loading import (
    ModelLoadError,
    hf_name,
    load_model,
    read_hf_config,
    read_safetensors,
    save_model,
    save_tokenizer,
    source_dtype,
)

# On a shared 2-core machine torch's second intra-op thread mostly spins: one thread runs the
# reference model up to 15x faster.
torch.set_num_threads(1)

QWEN_VOCAB = 151936  # Qwen2.5's embedding rows; the tokenizer's ids all fit.
MESSAGES = [{"role": "system", "content": "You are a Sokoban solver."},
            {"role": "user", "content": "Push the box onto the target. <answer>Up</answer>?"}]


def tiny_qwen2(tie: bool, dtype=torch.float32):
    torch.manual_seed(0)
    # transformers 5 still takes rope_theta (into rope_parameters) but its signature no longer lists it; 4.x needs it
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tie)  # type: ignore[call-arg]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms and biases too, so a misplaced tensor shows in the logits
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.3)
    return model.to(dtype)


def save_hf_folder(folder, model, tokenizer, **save_kwargs):
    model.save_pretrained(folder, **save_kwargs)
    tokenizer.save_pretrained(folder)
    return folder


def jax_logits(model, tokens: np.ndarray) -> np.ndarray:
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(tokens, positions))


def torch_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory, qwen_tokenizer):
    model = tiny_qwen2(tie=True)
    return save_hf_folder(tmp_path_factory.mktemp("tied"), model, qwen_tokenizer), model


@pytest.fixture(scope="module")
def tied_loaded(tied_folder):
    return load_model(tied_folder[0])


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory, qwen_tokenizer):
    model = tiny_qwen2(tie=False)
    folder = save_hf_folder(tmp_path_factory.mktemp("sharded"), model, qwen_tokenizer, max_shard_size="4MB")
    return folder, model


@pytest.fixture(scope="module")
def tokens(qwen_tokenizer):
    text = qwen_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return np.asarray([qwen_tokenizer(text)["input_ids"]])


# --- reading ----------------------------------------------------------------------------------


def test_sharded_folder_reads_every_tensor_exactly(sharded_folder):
    folder, model = sharded_folder
    assert len(json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(folder.glob("model-*.safetensors"))) > 1
    tensors = read_safetensors(folder)
    expected = model.state_dict()
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value.numpy(), err_msg=name)
    assert read_hf_config(folder)["model_type"] == "qwen2"


def test_bfloat16_checkpoint_keeps_its_bits(tmp_path, qwen_tokenizer):
    model = tiny_qwen2(tie=True, dtype=torch.bfloat16)
    tensors = read_safetensors(save_hf_folder(tmp_path, model, qwen_tokenizer))
    weight = model.model.layers[0].mlp.up_proj.weight
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype.name == "bfloat16"
    np.testing.assert_array_equal(tensors["model.layers.0.mlp.up_proj.weight"].astype(np.float32),
                                  weight.detach().float().numpy())


@pytest.mark.parametrize("which", ["tied", "sharded"])
def test_folder_logits_match_transformers(which, tied_folder, tied_loaded, sharded_folder, tokens):
    if which == "tied":
        (model, tokenizer), reference = tied_loaded, tied_folder[1]
    else:
        (model, tokenizer), reference = load_model(sharded_folder[0]), sharded_folder[1]
    np.testing.assert_allclose(jax_logits(model, tokens), torch_logits(reference, tokens), atol=1e-4, rtol=0)
    assert tokenizer(tokenizer.apply_chat_template(MESSAGES, tokenize=False))["input_ids"][:20] == \
        tokens[0, :20].tolist()


# --- saving -----------------------------------------------------------------------------------


def test_saved_folder_loads_in_transformers_with_same_logits_and_tokenizer(tmp_path, tied_folder, tied_loaded,
                                                                          tokens, qwen_tokenizer):
    reference = tied_folder[1]
    model, tokenizer = tied_loaded
    out = save_model(model, tokenizer, tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["saved"]  # no staging folder left behind
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    np.testing.assert_allclose(torch_logits(reloaded, tokens), torch_logits(reference, tokens), atol=1e-5, rtol=0)
    reloaded_tokenizer = AutoTokenizer.from_pretrained(out)
    for tok in (qwen_tokenizer, reloaded_tokenizer):
        assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
            qwen_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reloaded_tokenizer("<answer>Left || Up</answer>")["input_ids"] == \
        qwen_tokenizer("<answer>Left || Up</answer>")["input_ids"]
    assert reloaded_tokenizer.eos_token == qwen_tokenizer.eos_token


def test_save_replaces_an_existing_folder(tmp_path, tied_loaded):
    model, tokenizer = tied_loaded
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.txt").write_text("old")
    save_model(model, tokenizer, target)
    assert not (target / "stale.txt").exists() and (target / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_bfloat16_model_saves_bfloat16_weights(tmp_path, tied_folder, tokens):
    model, tokenizer = load_model(tied_folder[0], dtype="bfloat16")
    assert model.config.param_dtype == "bfloat16"
    folder = save_model(model, tokenizer, tmp_path / "bf16")
    tensors = read_safetensors(folder)
    assert {t.dtype.name for t in tensors.values()} == {"bfloat16"}
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert reloaded.dtype == torch.bfloat16
    # bf16 weights and activations: within bf16 rounding of fp32 transformers, not equal.
    ours, expected = jax_logits(model, tokens), torch_logits(tied_folder[1], tokens)
    assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 0.05  # a wrong model: ~1.4


def test_export_takes_the_sources_dtype_or_one_asked_for(tmp_path, tied_folder, qwen_tokenizer):
    """trainer.export_dtype="source": a bfloat16 checkpoint's policy, trained in float32, exports
    at bfloat16 (half the disk), and config.json says so."""
    bf16_folder = save_hf_folder(tmp_path / "bf16_source", tiny_qwen2(tie=True, dtype=torch.bfloat16), qwen_tokenizer)
    assert source_dtype(bf16_folder) == "bfloat16" and source_dtype(tied_folder[0]) == "float32"
    model, tokenizer = load_model(bf16_folder, dtype="float32")
    folder = save_model(model, tokenizer, tmp_path / "exported", dtype=source_dtype(bf16_folder))
    assert {t.dtype.name for t in read_safetensors(folder).values()} == {"bfloat16"}
    assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16


# --- bad input --------------------------------------------------------------------------------


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="No checkpoint folder or GGUF file exists at"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="No checkpoint folder or GGUF file exists at"):
        load_model(str(tmp_path / "model.gguf"))


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path, tied_folder):
    folder, _ = tied_folder
    with pytest.raises(ModelLoadError, match="is a file but not a .gguf file"):
        load_model(folder / "config.json")


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(tmp_path)


def test_folder_without_weights_is_a_clear_error(tmp_path, tied_folder):
    folder = shutil.copytree(tied_folder[0], tmp_path / "ckpt")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="has neither model.safetensors nor model.safetensors.index.json"):
        load_model(folder)


def test_folder_without_tokenizer_is_a_clear_error(tmp_path, tied_folder):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tied_folder[0] / name, tmp_path)
    with pytest.raises(ModelLoadError, match="has no tokenizer files"):
        load_model(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_damaged_safetensors_names_the_file(tmp_path, tied_folder, damage):
    folder = shutil.copytree(tied_folder[0], tmp_path / "ckpt")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors file") as info:
        read_safetensors(folder)
    assert str(weights) in str(info.value)


def test_missing_shard_names_the_shard(tmp_path, sharded_folder):
    folder = shutil.copytree(sharded_folder[0], tmp_path / "ckpt")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"shard {shard} is missing"):
        read_safetensors(folder)


def test_unsupported_architecture_names_the_config(tmp_path, tied_folder):
    folder = shutil.copytree(tied_folder[0], tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{folder / 'config.json'}: unsupported model config"):
        load_model(folder)


def test_tensor_that_does_not_fit_the_config_names_the_folder(tmp_path, tied_folder):
    folder = shutil.copytree(tied_folder[0], tmp_path / "ckpt")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="mlp") as info:
        load_model(folder)
    assert str(folder) in str(info.value)


def test_offline_hub_is_one_clear_fast_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # a cached copy must not hide the error
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="Could not reach the Hugging Face hub to fetch 'Qwen/Qwen2.5-0.5B'") \
            as info:
        load_model("Qwen/Qwen2.5-0.5B")
    assert "smollm2-135m-instruct" in str(info.value) and ".gguf file" in str(info.value)


def test_unreachable_hub_is_one_clear_fast_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: refused at once
    with pytest.raises(ModelLoadError, match="Could not reach the Hugging Face hub"):
        load_model("Qwen/Qwen2.5-0.5B")


def test_saved_tokenizer_config_is_what_transformers_4_reads(tmp_path, smollm2_tokenizer):
    """transformers 4.x (the project supports >= 4.45) knows neither the class name 5.x writes
    (``TokenizersBackend``) nor ``chat_template.jinja``: the written config must name a class every
    version has and carry the chat template inline. Checked by hand with 4.45.2 as well."""
    save_tokenizer(smollm2_tokenizer, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == smollm2_tokenizer.chat_template
    assert "extra_special_tokens" not in config  # a 5.x key; 4.x reads additional_special_tokens
    assert (tmp_path / "tokenizer.json").is_file()  # what PreTrainedTokenizerFast is built from
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "<|im_start|>user\n<answer>Left || Up</answer><|im_end|>"
    assert reloaded(text)["input_ids"] == smollm2_tokenizer(text)["input_ids"]
    assert (reloaded.eos_token, reloaded.pad_token) == (smollm2_tokenizer.eos_token, smollm2_tokenizer.pad_token)


def test_saved_folder_honours_the_umask(tmp_path, tied_loaded):
    """A serving process of another user must read the export: 0755 / 0644 under umask 022."""
    model, tokenizer = tied_loaded
    old = os.umask(0o022)
    try:
        folder = save_model(model, tokenizer, tmp_path / "policy")
    finally:
        os.umask(old)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755
    files = list(folder.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in files), \
        {f.name: oct(f.stat().st_mode) for f in files}


def test_hf_name_is_what_a_hugging_face_client_resolves(tmp_path):
    assert hf_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"
    assert hf_name(tmp_path) == str(tmp_path.absolute())
    assert hf_name("smollm2-135m-instruct") is None  # bundled GGUF
    (tmp_path / "m.gguf").write_bytes(b"")
    assert hf_name(tmp_path / "m.gguf") is None
