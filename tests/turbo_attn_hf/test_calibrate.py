"""Head-wise 2-bit calibration (gap x std) on tiny models: a valid head map, the priority math on planted
K/V statistics, the YAML round trip and the CLI."""

import pytest
import torch

from turbo_attn_hf import calibrate as cal
from turbo_attn_hf.config import TurboConfig, TurboConfigError


def tiny_llama(layers=3, kv_heads=4, attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=kv_heads, head_dim=64, max_position_embeddings=512,
    )
    m = LlamaForCausalLM(cfg).eval()
    m.set_attn_implementation(attn)
    return m


def prompts(n=3, T=70, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (T,), generator=g) for _ in range(n)]


def test_block_gaps_known_values():
    x = torch.zeros(1, 4, 2)
    x[0, :, 0] = torch.tensor([0.0, 1.0, 5.0, 2.0])  # blocks of 2: gaps 1, 3
    x[0, :, 1] = torch.tensor([-1.0, 1.0, 0.0, 0.0])  # gaps 2, 0
    s, nb = cal._block_gaps(x, 2)
    assert nb == 2 and s.tolist() == [[4.0, 2.0]]
    s, nb = cal._block_gaps(x, 8)  # shorter than a block: one block
    assert nb == 1 and s.tolist() == [[5.0, 2.0]]


def test_priority_and_assignment_on_planted_stats():
    d = 8
    k = torch.ones(1, 3, d)
    k[0, 1, 0] = 20.0  # head 1: one wide outlier channel -> large mean x std
    k[0, 2] = 0.1  # head 2: narrow everywhere; std 0 -> priority 0
    gaps = cal.ChannelGaps(k=k, v=k.clone(), n_blocks=1, n_tokens=1)
    p = cal.head_priority(gaps, "kv")
    assert p.shape == (1, 3)
    assert p[0, 1] > p[0, 0] and p[0, 1] > p[0, 2]
    assert cal.assign_head_bits(p, 1, 4) == [[4, 4, 2]] or cal.assign_head_bits(p, 1, 4) == [[2, 4, 4]]
    # ties broken by head index (stable): heads 0 and 2 both have std 0 -> priority 0
    assert cal.assign_head_bits(p, 1, 4) == [[2, 4, 4]]
    assert cal.assign_head_bits(p, 2, 4) == [[2, 4, 2]]
    with pytest.raises(TurboConfigError, match="n_2bit_heads=4 must lie in"):
        cal.assign_head_bits(p, 4, 4)
    with pytest.raises(ValueError, match="use='q'"):
        cal.head_priority(gaps, "q")


def test_calibrate_tiny_model_valid_head_map(tmp_path):
    model = tiny_llama()
    cfg = cal.calibrate(model, prompts(), base="mixed", block_size=32)
    assert isinstance(cfg, TurboConfig)
    hb = cfg.head_bits
    assert len(hb) == 3 and all(len(row) == 4 for row in hb)
    assert all(sorted(row) == [2, 2, 4, 4] for row in hb)  # mixed: half of the 4 KV heads in 2 bits
    assert cfg.softmax == "sas" and cfg.block_size == 64 and cfg.name == "mixed_calibrated"
    assert cfg.calibration["n_prompts"] == 3 and cfg.calibration["n_blocks"] == 3 * 2
    # consistent with the config's own per-layer view
    assert cfg.layer_head_bits(1, 3, 4) == hb[1]
    # the 2-bit heads are the lowest-priority ones
    for row, pr in zip(hb, cfg.priority):
        two = [h for h, b in enumerate(row) if b == 2]
        four = [h for h, b in enumerate(row) if b == 4]
        assert max(pr[two]) <= min(pr[four])
    # YAML round trip, with the header as comments
    path = cal.write_config(cfg, tmp_path / "c.yaml", header="tiny test\nsecond line")
    text = path.read_text()
    assert text.startswith("# tiny test\n# second line\n# head priority")
    back = TurboConfig.from_yaml(path)
    assert back.head_bits == hb and back.name == "mixed_calibrated" and back.frac_2bit_heads == 0.5


def test_calibrate_explicit_n_and_errors():
    model = tiny_llama(layers=2, kv_heads=4)
    cfg = cal.calibrate(model, prompts(n=1), base="int4", n_2bit_heads=1)
    assert all(sorted(r) == [2, 4, 4, 4] for r in cfg.head_bits)
    with pytest.raises(TurboConfigError, match="stores no head in 2 bits"):
        cal.calibrate(model, prompts(n=1), base="int4")
    with pytest.raises(ValueError, match="no tokenizer"):
        cal.calibrate(model, ["text"], base="mixed")
    with pytest.raises(ValueError, match="at least one prompt"):
        cal.kv_channel_gaps(model, [])


def test_calibrate_restores_turbo_attention():
    pytest.importorskip("turbo_attn_hf.cache")
    import turbo_attn_hf  # noqa: F401

    model = tiny_llama(layers=1, kv_heads=2, attn="turbo_int8")
    cfg = cal.calibrate(model, prompts(n=1, T=20), base="mixed")
    assert cfg.head_bits[0].count(2) == 1
    assert model.config._attn_implementation == "turbo_int8"


def test_calibrate_cli_writes_config(tmp_path, monkeypatch):
    """The CLI end to end on a tiny model saved to disk with a word-level tokenizer (no Hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from turbo_attn_hf.eval import calibrate_cli
    from turbo_attn_hf.eval import data as edata

    if edata.find_data_dir() is None:
        pytest.skip("needs ../shared/data or $TURBO_ATTN_DATA")
    words = {f"w{i}": i for i in range(93)}
    words.update({"<unk>": 93, "<s>": 94, "</s>": 95})
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    model = tiny_llama(layers=2, kv_heads=4)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    path = calibrate_cli.main([
        "--model", str(tmp_path / "m"), "--dataset", "gsm8k", "--n", "2", "--no-shots", "--base", "mixed",
        "--name", "tiny_mixed", "--out-dir", str(tmp_path / "configs"), "--dtype", "float32", "--device", "cpu",
    ])
    cfg = TurboConfig.from_yaml(path)
    assert path.name == "tiny_mixed.yaml" and cfg.name == "tiny_mixed"
    assert [sorted(r) for r in cfg.head_bits] == [[2, 2, 4, 4]] * 2
    assert "2 gsm8k prompts" in path.read_text().splitlines()[1]
    assert len(calibrate_cli.calibration_prompts("bbh", 30, data_dir=None)) == 30
