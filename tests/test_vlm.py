"""Vision-language GSPO (issue 54): images from the data through the HF engine and the trainer's
forward, the two agreeing on every sampled token's log-prob; the frozen vision tower; the colour
recipe learning through ``gspo fit`` and its export answering images through transformers' Auto
classes alone."""

from __future__ import annotations

import csv
import io
import json
import random
import re
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image

from gspo_lightning.cli import main
from gspo_lightning.data.datamodule import DataError, PromptDataModule
from gspo_lightning.data.tasks.colours import COLOURS, draw_square
from gspo_lightning.models.loading import load_policy, load_tokenizer
from gspo_lightning.models.settings import Policy
from gspo_lightning.models.tiny import save_tiny
from gspo_lightning.models.vision import ImageRenderer, load_image_processor, vision_forward_inputs, vision_tower
from gspo_lightning.rollout.engine import EngineSpec, SamplingParams
from gspo_lightning.rollout.hf import HFEngine
from gspo_lightning.rollout.worker import build_rollout_tensors
from gspo_lightning.training.logprobs import response_logprobs

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def vlm_folder(tmp_path_factory):
    """builtin:tiny-vlm saved as a folder: the tests load it as users load a model, from disk."""
    torch.manual_seed(11)
    return str(save_tiny("tiny-vlm", tmp_path_factory.mktemp("tiny-vlm")))


def image_prompts(folder: str, images_per_prompt: list[int], seed: int):
    """Prompts of ``colour`` with that many images each (different sizes, so different grids)."""
    tokenizer = load_tokenizer(folder)
    renderer = ImageRenderer(tokenizer, load_image_processor(folder))
    rng = random.Random(seed)
    ids, images = [], []
    for count in images_per_prompt:
        content = [*({"type": "image"} for _ in range(count)), {"type": "text", "text": "colour"}]
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
        pictures = [draw_square(rng.choice(sorted(COLOURS)), rng).resize((28 + 28 * rng.randint(1, 2), 56))
                    for _ in range(count)]
        prompt_ids, inputs = renderer.render(text, pictures)
        ids.append(prompt_ids)
        images.append(inputs)
    return tokenizer, ids, images


@pytest.mark.parametrize("images_per_prompt,temperature,top_k", [([1, 1, 1], 1.0, 0), ([1, 2, 3], 1.3, 8)])
def test_engine_and_trainer_logprobs_agree_over_image_prompts(vlm_folder, images_per_prompt, temperature, top_k):
    tokenizer, ids, images = image_prompts(vlm_folder, images_per_prompt, seed=5)
    policy = load_policy(vlm_folder, tokenizer)
    assert type(policy).__name__ == "Qwen2_5_VLForConditionalGeneration"
    engine = HFEngine()
    engine.start(EngineSpec(vlm_folder, "float32", 64, 12, 0, [tokenizer.eos_token_id], tokenizer.pad_token_id, policy=policy))
    group = 8
    generation = engine.generate(ids, group, SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k),
                                 seed=7, images=images)
    tensors = build_rollout_tensors(ids, generation, group, tokenizer.pad_token_id, torch.device("cpu"))
    rows_images = [entry for entry in images for _ in range(group)]
    with torch.no_grad():
        trainer_logprobs, _ = response_logprobs(policy, tensors["input_ids"], tensors["attention_mask"],
                                                tensors["prompt_width"], temperature=temperature, top_k=top_k,
                                                images=rows_images)
    mask = tensors["response_mask"]
    assert mask.sum() > 100
    assert (trainer_logprobs - tensors["engine_logprobs"])[mask].abs().max() < 1e-5
    # the image placeholder is never sampled (a sampled one could not be told from an image's), though
    # a random model over 18 tokens would draw it about once in 17 tokens
    response = tensors["input_ids"][:, tensors["prompt_width"]:]
    assert not ((response == policy.config.image_token_id) & mask).any()
    # the trainer scores under that distribution: the placeholder's probability is 0, the others sum to 1
    with torch.no_grad():
        inputs = vision_forward_inputs(policy, tensors["input_ids"][:1], tensors["attention_mask"][:1], rows_images[:1])
        assert inputs["position_ids"].shape == (3, 1, tensors["input_ids"].shape[1])
    # the images matter: the same responses scored with another prompt's images differ
    swapped = [images[(i // group + 1) % len(images)] for i in range(len(rows_images))]
    if [e["image_grid_thw"].tolist() for e in swapped] == [e["image_grid_thw"].tolist() for e in rows_images]:
        with torch.no_grad():
            other, _ = response_logprobs(policy, tensors["input_ids"], tensors["attention_mask"], tensors["prompt_width"],
                                         temperature=temperature, top_k=top_k, images=swapped)
        assert (other - trainer_logprobs)[mask].abs().max() > 1e-3


def test_positions_and_log_probs_match_transformers_own_forward(vlm_folder):
    """An independent oracle: transformers' forward computes the M-RoPE positions and scatters the
    image embeddings itself (from ``mm_token_type_ids``); ours must give the same log-probs."""
    tokenizer, ids, images = image_prompts(vlm_folder, [2], seed=9)
    policy = load_policy(vlm_folder, tokenizer).eval()
    response = [tokenizer.convert_tokens_to_ids(w) for w in ("red", "blue", "green")]
    input_ids = torch.tensor([ids[0] + response])
    mask = torch.ones_like(input_ids)
    with torch.no_grad():
        ours, _ = response_logprobs(policy, input_ids, mask, len(ids[0]), images=images)
        logits = policy(input_ids=input_ids, attention_mask=mask, pixel_values=images[0]["pixel_values"],
                        image_grid_thw=images[0]["image_grid_thw"],
                        mm_token_type_ids=(input_ids == policy.config.image_token_id).int()).logits
    # the image and video placeholders are never sampled: probability 0, the rest renormalized
    logits[..., [policy.config.image_token_id, policy.config.video_token_id]] = float("-inf")
    theirs = torch.log_softmax(logits[0, len(ids[0]) - 1:-1].float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    assert torch.allclose(ours[0], theirs, atol=1e-6), (ours, theirs)


def write_rows(folder: Path, rows: list[dict]) -> Path:
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def png_bytes(colour=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_images_column_takes_paths_bytes_and_images(tmp_path, vlm_folder):
    (tmp_path / "img").mkdir()
    Image.new("RGB", (56, 56), (10, 200, 10)).save(tmp_path / "img" / "a.png")
    messages = [{"role": "user", "content": [{"type": "text", "text": "colour"}, {"type": "image"}, {"type": "image"}]}]
    rows = [{"prompt": "colour", "images": "img/a.png"},  # relative to the data file's folder
            {"prompt": messages, "images": ["img/a.png", str(tmp_path / "img" / "a.png")]}]
    data = PromptDataModule(path=str(write_rows(tmp_path, rows)), tokenizer=vlm_folder, val_size=0, prompt_length=64)
    data.setup("fit")
    first, second = data.train_rows
    image = data.image_renderer.image_token_id
    assert first["prompt_ids"].count(image) == 4 and second["prompt_ids"].count(image) == 8  # 4 merged patches each
    # every word of the rendered prompt is in the vocabulary (the template's newlines survive trim_blocks)
    assert load_tokenizer(vlm_folder).unk_token_id not in first["prompt_ids"] + second["prompt_ids"]
    batch = data.collate(data.train_rows)
    assert batch["images"][1]["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]
    # the chat messages keep their own order: the text before the images
    assert second["prompt_ids"].index(image) > second["prompt_ids"].index(load_tokenizer(vlm_folder).convert_tokens_to_ids("colour"))
    assert len(batch["images"]) == 2
    # bytes, a datasets Image feature and a PIL image render the same pixels as the file
    same = PromptDataModule(path="builtin:echo", tokenizer=vlm_folder, val_size=0, prompt_length=64)
    for value in (png_bytes((10, 200, 10)), {"bytes": png_bytes((10, 200, 10)), "path": None},
                  Image.new("RGB", (56, 56), (10, 200, 10))):
        kept, _ = same._prepare([{"prompt": "colour", "images": [value]}], "rows")
        assert torch.equal(same.collate(kept)["images"][0]["pixel_values"], batch["images"][0]["pixel_values"])


@pytest.mark.parametrize("images,expected", [
    (["missing.png"], "no file"),
    ([b"not an image"], "not a readable image"),
    ([42], "is a int"),
])
def test_a_bad_image_is_a_bad_row(tmp_path, vlm_folder, images, expected):
    rows = [{"prompt": "colour", "images": [png_bytes()]}]
    bad = {"prompt": "colour", "images": images}
    data = PromptDataModule(path="builtin:echo", tokenizer=vlm_folder, val_size=0, prompt_length=64)
    with pytest.raises(DataError, match=rf"rows row 2: .*{expected}.*data.bad_rows=skip"):
        data._prepare([*rows, bad], "rows")
    skipping = PromptDataModule(path="builtin:echo", tokenizer=vlm_folder, val_size=0, prompt_length=64, bad_rows="skip")
    kept, counts = skipping._prepare([*rows, bad], "rows")
    assert len(kept) == 1 and counts["bad"] == 1


def test_image_prompts_that_do_not_fit_are_refused_not_cut(vlm_folder):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour"}]}]
    data = PromptDataModule(path="builtin:echo", tokenizer=vlm_folder, val_size=0, prompt_length=6)
    with pytest.raises(DataError, match="cannot be cut: raise data.prompt_length"):
        data._prepare([{"prompt": messages, "images": [png_bytes()]}], "rows")
    with pytest.raises(DataError, match="1 image placeholder"):  # two images for one image part
        data._prepare([{"prompt": messages, "images": [png_bytes(), png_bytes()]}], "rows")
    dropping = PromptDataModule(path="builtin:echo", tokenizer=vlm_folder, val_size=0, prompt_length=6,
                                overlong_prompts="drop")
    kept, counts = dropping._prepare([{"prompt": messages, "images": [png_bytes()]}], "rows")
    assert kept == [] and counts["dropped"] == 1


def test_a_text_model_refuses_image_prompts(vlm_folder):
    tokenizer, ids, images = image_prompts(vlm_folder, [1], seed=1)
    torch.manual_seed(0)
    text_policy = load_policy("builtin:tiny-echo", load_tokenizer("builtin:tiny-echo"))
    engine = HFEngine()
    engine.start(EngineSpec("builtin:tiny-echo", "float32", 64, 4, 0, [1], 0, policy=text_policy))
    with pytest.raises(Exception, match="the policy .* is a text model"):
        engine.generate([[3, 4]], 2, SamplingParams(max_new_tokens=2), seed=0, images=images)


def metrics(run: Path) -> list[dict]:
    return list(csv.DictReader(open(next(run.rglob("metrics.csv")))))


def test_the_colour_recipe_learns_and_its_export_sees(tmp_path):
    """configs/quickstart_vlm.yaml through ``gspo fit``, seed 3: held-out accuracy from chance to
    >= 0.9; the vision tower frozen (the checkpoint keeps it); the export answers fresh images
    through AutoModelForImageTextToText, AutoTokenizer and AutoImageProcessor alone."""
    main(["fit", "--config", str(ROOT / "configs" / "quickstart_vlm.yaml"), f"--trainer.default_root_dir={tmp_path}",
          "--trainer.enable_progress_bar=false", "--seed_everything=3"])
    evals = [json.loads(line) for line in next(tmp_path.rglob("eval_results.jsonl")).read_text().splitlines()]
    assert evals[0]["val/accuracy"] < 0.5 and max(e["val/accuracy"] for e in evals) >= 0.9, evals
    rows = [r for r in metrics(tmp_path) if r.get("engine/logprob_abs_diff")]
    assert max(float(r["engine/logprob_abs_diff"]) for r in rows) < 1e-5

    checkpoint = torch.load(next(tmp_path.rglob("last.ckpt")), map_location="cpu", weights_only=True)
    towers = {k for k in checkpoint["state_dict"] if ".visual." in k}
    assert towers and all(k.startswith("policy.") for k in towers)  # the policy's; the reference shares it

    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    folder = next(tmp_path.rglob("hf_model"))
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    tokenizer, processor = AutoTokenizer.from_pretrained(folder), AutoImageProcessor.from_pretrained(folder)
    # the untrained tower, as built from the run's seed, is the exported one: it never trained
    trained_tower = {k[len("policy."):]: v for k, v in checkpoint["state_dict"].items() if k in towers}
    exported = dict(model.named_parameters())
    assert all(torch.equal(exported[k], v) for k, v in trained_tower.items() if k in exported)
    rng, right = random.Random(2026), 0
    for _ in range(32):
        colour = rng.choice(sorted(COLOURS))
        pixels = processor(images=[draw_square(colour, rng)], return_tensors="pt")
        text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour"}]}],
                                             tokenize=False, add_generation_prompt=True)
        tokens = int(pixels["image_grid_thw"].prod()) // processor.merge_size ** 2
        inputs = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * tokens), add_special_tokens=False, return_tensors="pt")
        out = model.generate(**inputs, **pixels, max_new_tokens=2, do_sample=False)
        words = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).split()
        right += bool(words) and words[0] == colour
    assert right / 32 >= 0.9, right
    # docs/vlm.md's example, on this export
    doc = (ROOT / "docs" / "vlm.md").read_text()
    code = re.search(r"## Using the export outside the trainer\n.*?```python\n(.*?)```", doc, re.S).group(1)
    line = 'folder = "runs/quickstart_vlm/csv/version_0/hf_model"'
    assert line in code
    namespace: dict = {}
    exec(code.replace(line, f"folder = {str(folder)!r}"), namespace)  # noqa: S102 - the docs' own code
    assert namespace["answer"].split()[0] == "blue"


def test_the_vision_tower_is_frozen_by_default_and_trains_when_asked(tmp_path):
    from gspo_lightning.rewards import RewardSpec
    from tests.helpers_fit import make_module

    def run(freeze: bool, folder: Path):
        module = make_module(model_name_or_path="builtin:tiny-vlm", response_length=2, use_kl_loss=True,
                             rewards=[RewardSpec(function="gspo_lightning.data.tasks.colours.colour_reward")],
                             policy=Policy(freeze_vision=freeze))
        module.configure_model()
        before = {k: v.clone() for k, v in vision_tower(module.policy).state_dict().items()}
        language = module.policy.lm_head.weight.clone()
        L.seed_everything(0, verbose=False)
        data = PromptDataModule(path="builtin:colours", tokenizer="builtin:tiny-vlm", rollout_batch_size=4,
                                prompt_length=16, val_size=0)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                            limit_val_batches=0, default_root_dir=folder)
        trainer.fit(module, datamodule=data)
        after = vision_tower(module.policy).state_dict()
        changed = any(not torch.equal(before[k], after[k]) for k in before)
        return module, changed, not torch.equal(language, module.policy.lm_head.weight)

    module, tower_changed, language_changed = run(True, tmp_path / "frozen")
    assert language_changed and not tower_changed
    assert vision_tower(module.reference) is vision_tower(module.policy)  # one tower in memory
    module, tower_changed, language_changed = run(False, tmp_path / "trained")
    assert language_changed and tower_changed
    assert vision_tower(module.reference) is not vision_tower(module.policy)


def test_an_environment_that_replies_with_an_image(vlm_folder):
    """Episodes: the environment's reply holds an image part; its tokens are the image's (expanded),
    in the sequence but not trained on; the engine's and the trainer's log-probs agree over the
    whole episode, the environment's image in the middle."""
    from gspo_lightning.data.tasks.colours import make_episode_rows
    from gspo_lightning.episodes import ShowImageEnvironment
    from gspo_lightning.episodes.multi_turn import MultiTurn
    from gspo_lightning.rollout.episodes import run_episodes

    tokenizer = load_tokenizer(vlm_folder)
    policy = load_policy(vlm_folder, tokenizer)
    engine = HFEngine()
    engine.start(EngineSpec(vlm_folder, "float32", 16, 16, 0, [tokenizer.eos_token_id], tokenizer.pad_token_id, policy=policy))
    episodes = MultiTurn(environment=ShowImageEnvironment(), max_turns=2, max_turn_tokens=3, end_of_turn="")
    episodes.start(tokenizer, 16, image_renderer=ImageRenderer(tokenizer, load_image_processor(vlm_folder)))
    rows = make_episode_rows(3, seed=4)
    batch = run_episodes(episodes, engine, [r["prompt"] for r in rows], rows, 4, SamplingParams(max_new_tokens=16), seed=9)
    assert batch.images is not None and len(batch.images) == 12
    shown = [entry is not None for entry in batch.images]
    assert any(shown)  # the episodes whose first turn left room for the picture
    tensors = build_rollout_tensors(batch.prompt_ids, batch.generation, 1, tokenizer.pad_token_id, torch.device("cpu"),
                                    loss_mask=batch.loss_mask)
    response = tensors["input_ids"][:, tensors["prompt_width"]:]
    image_tokens = response == policy.config.image_token_id
    assert (image_tokens.sum(-1) == 4 * torch.tensor(shown)).all()  # 4 merged patches, where it was shown
    assert not (image_tokens & tensors["response_mask"]).any()  # the environment's: never trained on
    with torch.no_grad():
        trainer_logprobs, _ = response_logprobs(policy, tensors["input_ids"], tensors["attention_mask"],
                                                tensors["prompt_width"], images=batch.images)
    mask = tensors["response_mask"]
    assert (trainer_logprobs - tensors["engine_logprobs"])[mask].abs().max() < 1e-5
    # a text policy cannot be shown the picture: one clear line
    text_episodes = MultiTurn(environment=ShowImageEnvironment(), max_turns=2, max_turn_tokens=3, end_of_turn="")
    text_episodes.start(tokenizer, 16)
    with pytest.raises(Exception, match="the policy is a text model"):
        run_episodes(text_episodes, engine, [r["prompt"] for r in rows], rows, 4, SamplingParams(max_new_tokens=16), seed=9)


def test_episodes_with_images_train_through_gspo_fit(tmp_path):
    main(["fit", "--config", str(ROOT / "configs" / "quickstart_vlm.yaml"), f"--trainer.default_root_dir={tmp_path}",
          "--trainer.enable_progress_bar=false", "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
          "--trainer.num_sanity_val_steps=0", "--model.export_on_fit_end=false", "--seed_everything=6",
          "--data.path=builtin:colours-episodes", "--model.rollout.response_length=12",
          "--model.episodes.environment=gspo_lightning.episodes.ShowImageEnvironment",
          "--model.episodes.max_turns=2", "--model.episodes.max_turn_tokens=3", "--model.episodes.end_of_turn=",
          "--model.rewards=[]"])
    rows = [r for r in metrics(tmp_path) if r.get("engine/logprob_abs_diff")]
    assert len(rows) == 3
    assert max(float(r["engine/logprob_abs_diff"]) for r in rows) < 1e-5
    assert all(float(r["episode/turns"]) > 1 for r in rows)


def test_lora_adapts_the_language_model_only(tmp_path, vlm_folder):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from gspo_lightning.models.lora import LoRA, attach_lora, save_adapter

    tokenizer = load_tokenizer(vlm_folder)
    policy = attach_lora(load_policy(vlm_folder, tokenizer), LoRA(rank=4, alpha=8))
    adapted = {name for name, p in policy.named_parameters() if p.requires_grad}
    assert adapted and not any(".visual." in name for name in adapted)
    assert any("language_model" in name for name in adapted)
    save_adapter(policy, tmp_path / "adapter", vlm_folder, LoRA(rank=4, alpha=8))
    reloaded = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(vlm_folder), tmp_path / "adapter")
    assert not any(".visual." in name and "lora_" in name for name, _ in reloaded.named_parameters())


def draw_colour(colour: str):
    """Draw a square of a colour.

    Args:
        colour: red, green, blue or yellow.
    """
    return draw_square(colour, random.Random(0))


def test_a_tool_that_returns_an_image(vlm_folder):
    """A tool's PIL image becomes its reply's image part, rendered into the episode's tokens."""
    import asyncio

    from gspo_lightning.episodes import ToolEnvironment
    from gspo_lightning.episodes.multi_turn import MultiTurn
    from gspo_lightning.rollout.episodes import _with_images

    environment = ToolEnvironment(tools=[draw_colour])
    environment.reset({}, [{"role": "user", "content": "colour"}])
    call = '<tool_call>{"name": "draw_colour", "arguments": {"colour": "red"}}</tool_call>'
    result = asyncio.run(environment.astep({"role": "assistant", "content": call}))
    (reply,) = result.messages
    assert reply["role"] == "tool" and reply["content"][0]["type"] == "image"
    assert reply["content"][0]["image"].size == (56, 56)  # the tool's own image
    tokenizer = load_tokenizer(vlm_folder)
    episodes = MultiTurn(environment=environment, max_turns=2, end_of_turn="", system_prompt_for_tools=None)
    episodes.start(tokenizer, 64, image_renderer=ImageRenderer(tokenizer, load_image_processor(vlm_folder)))
    messages = [{"role": "user", "content": "colour"}, {"role": "assistant", "content": "red"}]
    ids = episodes.renderer.continuation_ids(messages, result.messages)
    expanded, images = _with_images(episodes, ids, result.messages)
    assert expanded.count(tokenizer.convert_tokens_to_ids("<|image_pad|>")) == 4 and len(images) == 1
    assert images[0]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_asynchronous_rollouts_with_images_resume(tmp_path):
    """A rollout generated ahead (max_staleness 1) carries its images into the checkpoint
    (weights_only) and out again: the resumed run trains on it."""
    common = ["fit", "--config", str(ROOT / "configs" / "quickstart_vlm.yaml"), f"--trainer.default_root_dir={tmp_path}",
              "--trainer.enable_progress_bar=false", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0",
              "--model.export_on_fit_end=false", "--model.max_staleness=1", "--data.rollout_batch_size=4",
              "--model.engine=gspo_lightning.rollout.HFCopyEngine", "--model.engine.dtype=float32",
              "--model.off_policy.mode=decoupled"]
    main([*common, "--trainer.max_steps=2"])
    checkpoint = next(tmp_path.rglob("last.ckpt"))
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    pending = [item["rollout"] for rank in state["gspo"]["ranks"]
               for item in (rank.get("pending_rollouts") or {}).get("pending", []) if item.get("rollout")]
    main([*common, "--trainer.max_steps=3", f"--ckpt_path={checkpoint}"])
    rows = [r for r in metrics(tmp_path) if r.get("engine/logprob_abs_diff")]
    assert len(rows) == 3
    # a rollout sampled by the weights it trains (lag 0) agrees with the trainer to float32 rounding;
    # one generated ahead differs by the update in between (the off-policy correction's business)
    fresh = [float(r["engine/logprob_abs_diff"]) for r in rows if float(r["async/lag"]) == 0]
    assert fresh and max(fresh) < 1e-5
    assert any(float(r["async/lag"]) >= 1 for r in rows[1:])
    assert pending and all(p["images"] and p["images"][0]["pixel_values"].numel() for p in pending)
