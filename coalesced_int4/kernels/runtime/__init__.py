"""What a kernel launch sets up around the kernel: programmatic dependent launch, the shared
memory carveout, global scratch for device-made TMA descriptors, device queries."""
