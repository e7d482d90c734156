"""Moving bytes: the copy engine (native or torch) from device/host tensors into shared memory."""
