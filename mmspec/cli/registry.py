"""Where the `mmspec` command finds its subcommands.

Each entry names a module that defines `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `mmspec --help` stays fast and one broken optional dependency does not break
every command. Add a command by adding one line here.
"""

from __future__ import annotations

# top-level commands: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "selfcheck": ("mmspec.cli.selfcheck", "check the installation: core rules, kernels, a toy speculative run"),
    "generate": ("mmspec.cli.generate", "generate images with a family and method (writes PNGs, a grid, stats)"),
    "vlm": ("vlm.cli", "answer questions about images with a LLaVA target and a speculative drafter"),
    "bench": ("mmspec.bench.cli", "benchmark vanilla vs speculative methods side by side in one process"),
}

# `mmspec convert <name>`: official checkpoints -> a pipeline folder
CONVERT_COMMANDS: dict[str, tuple[str, str]] = {
    "llamagen": ("image_ar.llamagen.convert_pipeline", "official LlamaGen GPT + VQ files -> a pipeline folder"),
    "var": ("image_ar.var.convert_pipeline", "official VAR transformer(s) + VQVAE files -> a VAR or CoDe pipeline"),
    "mar": ("continuous.mar.convert_pipeline", "official MAR checkpoint(s) + kl16.ckpt -> a MAR or CSpD pipeline"),
}

# `mmspec train <name>`: name -> (module, one-line help)
TRAIN_COMMANDS: dict[str, tuple[str, str]] = {
    "tokenizer": ("mmspec.data.train_tokenizer", "train the world's text tokenizer (tokenizers BPE)"),
    "judge": ("mmspec.metrics.train_judge", "train the shapes-world classifier used as the image judge"),
    "llamagen": ("image_ar.llamagen.train", "train the embedded LlamaGen default: VQ tokenizer, target, draft model"),
    "llamagen-drafter": ("image_ar.llamagen.train_eagle", "train an EAGLE drafter (LANTERN recipe) for LlamaGen"),
    "var": ("image_ar.var.train", "train the embedded VAR default: multi-scale VQVAE, large and small VAR (CoDe)"),
    "var-code": ("image_ar.var.train_code", "CoDe fine-tuning of a VAR pair: large on its scales, small distilled"),
    "mar": ("continuous.mar.train", "train the embedded MAR default: KL VAE, target MAR, draft MAR (CSpD)"),
    "mar-draft": ("continuous.mar.distill", "distil a CSpD draft MAR from its target (agrees on shared trajectories)"),
    "vlm-drafter": ("vlm.train_drafter", "train a VLM drafter (EagleVLM) on a LLaVA target's own long answers"),
    "vlm": ("vlm.train", "train the embedded VLM default: a small LLaVA target on the world's questions"),
}
