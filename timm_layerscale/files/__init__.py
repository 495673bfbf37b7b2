"""The file edge: reading checkpoints, resolving sources, writing files atomically.

- :mod:`.sources`: a file, folder, ``https://`` URL or ``hf-hub:`` id made a local file (downloads cached);
- :mod:`.read`: loading checkpoints without running their code, hashes, the NaN/Inf check;
- :mod:`.save`: streaming safetensors and ``torch.save`` writers;
- :mod:`.atomic`: temporaries, publishing them, and cleaning up after killed writers;
- :mod:`.hub_errors`: huggingface_hub's exceptions as one-line messages.
"""
