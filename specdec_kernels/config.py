"""Process-wide settings.

check_values: run the input checks that read tensor values (token ids in range, parents in
    topological order, ...). On GPU they cost a device->host sync per call; a serving loop
    that builds its own inputs can turn them off. They are skipped automatically under
    torch.compile and during CUDA-graph capture.
"""

check_values: bool = True
