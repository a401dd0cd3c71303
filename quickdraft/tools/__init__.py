"""The tools users run around the engine: bench, tune, verify, doctor (and what they measure with: roofline,
quality, the bundled prompts, conversations), export and remote (other engines). The engine never imports them."""
