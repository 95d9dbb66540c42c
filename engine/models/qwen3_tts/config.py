"""Qwen3-TTS configuration: the talker (a Qwen3 LM over the codec vocabulary with a text track), its
code predictor, the prompt's special ids, the variant, and the generation defaults.

Read from the hub checkpoint's config.json (model_type `qwen3_tts`: `talker_config` with a nested
`code_predictor_config`, the text ids `tts_*_token_id` / `im_*_token_id` at the top) and
generation_config.json. Presets: the released sizes (`0.6b`, `1.7b`; shapes as the ports of the
released config.json report them) and `tiny` (tests, random checkpoints). A real checkpoint's
config.json always wins over a preset: speakers, languages and special ids come from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from higgs_stream.engine.config_fields import (
    REQUIRED,
    bool_field,
    dict_field,
    dtype_fields,
    float_field,
    int_field,
    token_id_field,
)
from higgs_stream.engine.errors import CheckpointError, ConfigError
from higgs_stream.engine.talker_config import backbone_dims, max_positions_field

MODEL_TYPE = "qwen3_tts"
VARIANTS = ("base", "custom_voice", "voice_design")
NUM_GROUPS = 16  # code groups per frame: group 0 from the talker, 1..15 from the code predictor


def unique_lower(names: dict[str, Any], where: str) -> dict[str, Any]:
    """`names` (speakers, languages: looked up in lower case), ConfigError when two differ only by case ("Ryan" and
    "ryan" became one, the last id winning: a probe)."""
    seen: dict[str, str] = {}
    for name in names:
        if name.lower() in seen:
            raise ConfigError(f"{where} has {seen[name.lower()]!r} and {name!r}: names must differ by more than case")
        seen[name.lower()] = name
    return names


@dataclass(frozen=True)
class CodePredictorConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"qwen3_tts code predictor {name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ConfigError(f"qwen3_tts code predictor heads ({self.num_heads}) must be a multiple of kv heads "
                              f"({self.num_kv_heads}) and head_dim ({self.head_dim}) even")


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json: the talker's (group 0) and the code predictor's ("subtalker") sampling."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_do_sample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 8192


@dataclass(frozen=True)
class QwenTTSConfig:
    # talker (names as the engine's KV cache reads them)
    vocab_size: int  # the codec vocabulary: codes 0..codebook_size-1, then specials
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    text_vocab_size: int
    text_hidden_size: int
    code_predictor: CodePredictorConfig
    codebook_size: int = 2048
    num_codebooks: int = NUM_GROUPS
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    # codec-track special ids (talker vocabulary)
    codec_pad_id: int = 2148
    codec_bos_id: int = 2149
    codec_eos_id: int = 2150
    codec_think_id: int = 2154
    codec_nothink_id: int = 2155
    codec_think_bos_id: int = 2156
    codec_think_eos_id: int = 2157
    speakers: dict[str, int] = field(default_factory=dict)  # lower-case name -> codec id (CustomVoice)
    speaker_dialects: dict[str, str | bool] = field(default_factory=dict)  # name -> dialect language or False
    languages: dict[str, int] = field(default_factory=dict)  # lower-case language -> codec id
    # text-track ids (text vocabulary)
    tts_pad_id: int = 151671
    tts_bos_id: int = 151672
    tts_eos_id: int = 151673
    im_start_id: int = 151644
    im_end_id: int = 151645
    variant: str = "custom_voice"  # "base" | "custom_voice" | "voice_design"
    size: str = "0b6"
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    special: Any = None  # the contract's field (Engine compares it with the tokenizer's); Qwen keeps ids here

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "text_vocab_size", "text_hidden_size", "codebook_size", "num_codebooks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"qwen3_tts {name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ConfigError("qwen3_tts heads must be a multiple of kv heads and head_dim even")
        if self.variant not in VARIANTS:
            raise ConfigError(f"qwen3_tts variant must be one of {VARIANTS}, got {self.variant!r}")
        if self.num_codebooks != NUM_GROUPS:
            raise ConfigError(f"qwen3_tts writes {NUM_GROUPS} code groups per frame, got {self.num_codebooks}")
        specials = {n: getattr(self, n) for n in ("codec_pad_id", "codec_bos_id", "codec_eos_id", "codec_think_id",
                                                  "codec_nothink_id", "codec_think_bos_id", "codec_think_eos_id")}
        specials.update({f"speaker {k}": v for k, v in self.speakers.items()})
        specials.update({f"language {k}": v for k, v in self.languages.items()})
        bad = {k: v for k, v in specials.items() if not self.codebook_size <= v < self.vocab_size}
        if bad:
            raise ConfigError(f"qwen3_tts codec special ids must lie in [{self.codebook_size}, {self.vocab_size}): {bad}")
        for name, dialect in self.speaker_dialects.items():
            if dialect is not False and dialect not in self.languages:
                raise ConfigError(f"qwen3_tts speaker {name!r} has dialect {dialect!r}, not a language id")

    # ---- the engine's view ----
    @property
    def rope_scaling(self) -> None:
        """Plain RoPE (the talker's multimodal RoPE with equal position ids in its sections, as in TTS)."""
        return None

    @property
    def audio_stream_eos_id(self) -> int:
        """The engine's name for the id that ends a stream (group 0's EOS; engine/random_weights.py)."""
        return self.codec_eos_id

    @property
    def audio_vocab(self) -> int:
        """Ids one talker step samples from (group 0: codes and specials)."""
        return self.vocab_size

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def public_languages(self) -> tuple[str, ...]:
        """What a request may name ("auto" plus every language id that is not a dialect)."""
        return ("auto", *sorted(k for k in self.languages if "dialect" not in k))

    # ---- the on-disk form ----
    @classmethod
    def from_json(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                  source: str = "config.json", generation_source: str = "generation_config.json") -> QwenTTSConfig:
        """From the hub config.json (`raw`) and generation_config.json (`generation`, None: absent); CheckpointError
        naming the file (`source`, `generation_source`) and the field of a missing, wrongly typed or out-of-range
        value."""
        if raw.get("model_type") != MODEL_TYPE:
            raise CheckpointError(f"{source}: model_type {raw.get('model_type')!r}, expected {MODEL_TYPE!r}")
        t = raw.get("talker_config")
        if not isinstance(t, dict) or not isinstance(t.get("code_predictor_config"), dict):
            raise CheckpointError(f"{source}: needs a talker_config object with a code_predictor_config")
        c = t["code_predictor_config"]
        tw, cw = "talker_config.", "talker_config.code_predictor_config."

        def need(d: dict, key: str, where: str) -> int:
            """A required int field (sizes and ids; the dataclass checks which must be positive)."""
            if d.get(key) is None:
                raise CheckpointError(f"{source}: {where} lacks {key!r}")
            return int_field(d, key, f"{where}.", lo=0)

        try:
            dims = backbone_dims(t, tw)  # the Qwen3 talker: field-named type, range and head checks
            cp_dims = backbone_dims(c, cw)
            cp = CodePredictorConfig(
                hidden_size=cp_dims["hidden_size"], intermediate_size=cp_dims["intermediate_size"],
                num_layers=cp_dims["num_layers"], num_heads=cp_dims["num_heads"],
                num_kv_heads=cp_dims["num_kv_heads"], head_dim=cp_dims["head_dim"],
                rms_norm_eps=float_field(c, "rms_norm_eps", cw, 1e-6),
                rope_theta=float_field(c, "rope_theta", cw, 10000.0))
            groups = need(t, "num_code_groups", "talker_config")
            speakers, languages = dict_field(t, "spk_id", tw, {}), dict_field(t, "codec_language_id", tw, {})
            if c.get("num_code_groups", groups) != groups:
                raise ConfigError(f"talker and code predictor disagree on num_code_groups ({groups}, "
                                  f"{c.get('num_code_groups')})")
            text_vocab = int_field(t, "text_vocab_size", tw)
            dtype_fields(raw)
            dtype_fields(t, tw)

            def text_id(key: str, default: Any = REQUIRED) -> int:
                """An id of the text track (the text embedding: talker_config.text_vocab_size rows)."""
                return token_id_field(raw, key, "", default, vocab=text_vocab, table=f"{tw}text_vocab_size")

            try:  # generation_config.json's fields: its errors name that file
                generation_defaults = _generation(generation or {})
            except ConfigError as e:
                raise CheckpointError(f"{generation_source}: {e}") from e

            return cls(
                **dims, text_vocab_size=text_vocab,
                text_hidden_size=need(t, "text_hidden_size", "talker_config"), code_predictor=cp,
                codebook_size=cp_dims["vocab_size"], num_codebooks=groups,
                rms_norm_eps=float_field(t, "rms_norm_eps", tw, 1e-6),
                rope_theta=float_field(t, "rope_theta", tw, 10000.0),
                max_position_embeddings=max_positions_field(t, tw, 32768, groups),
                codec_pad_id=need(t, "codec_pad_id", "talker_config"), codec_bos_id=need(t, "codec_bos_id", "talker_config"),
                codec_eos_id=need(t, "codec_eos_token_id", "talker_config"),
                codec_think_id=need(t, "codec_think_id", "talker_config"),
                codec_nothink_id=need(t, "codec_nothink_id", "talker_config"),
                codec_think_bos_id=need(t, "codec_think_bos_id", "talker_config"),
                codec_think_eos_id=need(t, "codec_think_eos_id", "talker_config"),
                speakers={k.lower(): int_field(speakers, k, f"{tw}spk_id.", lo=0) for k in unique_lower(speakers,
                                                                                                       f"{tw}spk_id")},
                speaker_dialects={k.lower(): v for k, v in dict_field(t, "spk_is_dialect", tw, {}).items()},
                languages={k.lower(): int_field(languages, k, f"{tw}codec_language_id.", lo=0)
                           for k in unique_lower(languages, f"{tw}codec_language_id")},
                tts_pad_id=text_id("tts_pad_token_id"), tts_bos_id=text_id("tts_bos_token_id"),
                tts_eos_id=text_id("tts_eos_token_id"),
                im_start_id=text_id("im_start_token_id", 151644), im_end_id=text_id("im_end_token_id", 151645),
                variant=raw.get("tts_model_type") or "custom_voice", size=raw.get("tts_model_size") or "",
                generation=generation_defaults,
            )
        except (ConfigError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source}: {e}") from e

    def to_json(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(config.json, generation_config.json) in the hub layout (what make_checkpoint writes)."""
        cp = self.code_predictor
        rope = {"rope_type": "default", "interleaved": True, "mrope_section": _mrope_section(self.head_dim)}
        talker = dict(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=rope, num_code_groups=self.num_codebooks,
            text_vocab_size=self.text_vocab_size, text_hidden_size=self.text_hidden_size,
            codec_pad_id=self.codec_pad_id, codec_bos_id=self.codec_bos_id, codec_eos_token_id=self.codec_eos_id,
            codec_think_id=self.codec_think_id, codec_nothink_id=self.codec_nothink_id,
            codec_think_bos_id=self.codec_think_bos_id, codec_think_eos_id=self.codec_think_eos_id,
            spk_id=dict(self.speakers), spk_is_dialect=dict(self.speaker_dialects),
            codec_language_id=dict(self.languages),
            code_predictor_config=dict(
                vocab_size=self.codebook_size, hidden_size=cp.hidden_size, intermediate_size=cp.intermediate_size,
                num_hidden_layers=cp.num_layers, num_attention_heads=cp.num_heads,
                num_key_value_heads=cp.num_kv_heads, head_dim=cp.head_dim, rms_norm_eps=cp.rms_norm_eps,
                rope_theta=cp.rope_theta, num_code_groups=self.num_codebooks, hidden_act="silu"),
        )
        config = dict(model_type=MODEL_TYPE, architectures=["Qwen3TTSForConditionalGeneration"],
                      talker_config=talker, tokenizer_type="qwen3_tts_tokenizer_12hz", tts_model_size=self.size,
                      tts_model_type=self.variant, tts_pad_token_id=self.tts_pad_id, tts_bos_token_id=self.tts_bos_id,
                      tts_eos_token_id=self.tts_eos_id, im_start_token_id=self.im_start_id,
                      im_end_token_id=self.im_end_id)
        g = self.generation
        gen = dict(do_sample=g.do_sample, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
                   repetition_penalty=g.repetition_penalty, subtalker_dosample=g.subtalker_do_sample,
                   subtalker_temperature=g.subtalker_temperature, subtalker_top_k=g.subtalker_top_k,
                   subtalker_top_p=g.subtalker_top_p, max_new_tokens=g.max_new_tokens)
        return config, gen


def _generation(raw: dict[str, Any]) -> GenerationDefaults:
    """generation_config.json's sampling defaults, each typed and in range (ConfigError naming the field as the
    file spells it); absent fields keep GenerationDefaults'."""
    g = GenerationDefaults()
    sub_sample = "subtalker_dosample" if "subtalker_dosample" in raw else "subtalker_do_sample"  # the hub's spelling
    return GenerationDefaults(
        do_sample=bool_field(raw, "do_sample", "", g.do_sample),
        temperature=float_field(raw, "temperature", "", g.temperature),
        top_k=int_field(raw, "top_k", "", g.top_k, lo=0),  # 0: off, as in transformers
        top_p=float_field(raw, "top_p", "", g.top_p, hi=1.0),
        repetition_penalty=float_field(raw, "repetition_penalty", "", g.repetition_penalty),
        subtalker_do_sample=bool_field(raw, sub_sample, "", g.subtalker_do_sample),
        subtalker_temperature=float_field(raw, "subtalker_temperature", "", g.subtalker_temperature),
        subtalker_top_k=int_field(raw, "subtalker_top_k", "", g.subtalker_top_k, lo=0),
        subtalker_top_p=float_field(raw, "subtalker_top_p", "", g.subtalker_top_p, hi=1.0),
        max_new_tokens=int_field(raw, "max_new_tokens", "", g.max_new_tokens),
    )


def _mrope_section(head_dim: int) -> list[int]:
    """The talker's 3-section multimodal RoPE split (the released: head_dim 128 -> [24, 20, 20]). With
    equal position ids in all three sections, as TTS uses, it is plain RoPE."""
    half = head_dim // 2
    a = half - 2 * (half * 5 // 16)
    return [a, (half - a) // 2, half - a - (half - a) // 2]


# ---------------------------------------------------------------- presets
_SPEAKERS = ("vivian", "serena", "uncle_fu", "dylan", "eric", "ryan", "aiden", "ono_anna", "sohee")
_DIALECTS = {"dylan": "beijing_dialect", "eric": "sichuan_dialect"}
_LANGUAGES = ("chinese", "english", "german", "italian", "portuguese", "spanish", "japanese", "korean", "french",
              "russian", "beijing_dialect", "sichuan_dialect")


def preset(name: str, variant: str = "custom_voice") -> QwenTTSConfig:
    """`0.6b` / `1.7b` (the released shapes) or `tiny`; the speaker and language ids of a preset are
    placeholders in the special range (a real checkpoint's config.json carries its own)."""
    if name in ("0.6b", "1.7b"):
        big = name == "1.7b"
        cp = CodePredictorConfig(hidden_size=1024, intermediate_size=3072, num_layers=5, num_heads=16, num_kv_heads=8,
                                 head_dim=128)
        languages = {lang: 2050 + i for i, lang in enumerate(_LANGUAGES)}
        speakers = {s: 3000 + i for i, s in enumerate(_SPEAKERS)} if variant == "custom_voice" else {}
        return QwenTTSConfig(
            vocab_size=3072, hidden_size=2048 if big else 1024, intermediate_size=6144 if big else 3072, num_layers=28,
            num_heads=16, num_kv_heads=8, head_dim=128, text_vocab_size=151936, text_hidden_size=2048,
            code_predictor=cp, speakers=speakers,
            speaker_dialects={s: _DIALECTS.get(s, False) for s in speakers}, languages=languages, variant=variant,
            size="1b7" if big else "0b6")
    if name == "tiny":
        cp = CodePredictorConfig(hidden_size=8, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                                 head_dim=8, rope_theta=10000.0)
        speakers = {"aiden": 964, "dylan": 965} if variant == "custom_voice" else {}
        return QwenTTSConfig(
            vocab_size=1088, hidden_size=16, intermediate_size=40, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, text_vocab_size=160, text_hidden_size=24, code_predictor=cp, codebook_size=64,
            rope_theta=10000.0, max_position_embeddings=512, codec_pad_id=164, codec_bos_id=165, codec_eos_id=166,
            codec_think_id=170, codec_nothink_id=171, codec_think_bos_id=172, codec_think_eos_id=173,
            speakers=speakers, speaker_dialects={s: ("beijing_dialect" if s == "dylan" else False) for s in speakers},
            languages={"english": 66, "chinese": 71, "beijing_dialect": 84}, tts_pad_id=150, tts_bos_id=151,
            tts_eos_id=152, im_start_id=153, im_end_id=154, variant=variant, size="0b6")
    raise ConfigError(f"unknown qwen3_tts preset {name!r}; expected 0.6b, 1.7b or tiny")
