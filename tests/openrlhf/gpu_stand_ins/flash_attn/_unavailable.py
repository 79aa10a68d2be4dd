def unavailable(*args, **kwargs):
    raise RuntimeError("flash-attn is a stand-in on this CPU machine (tests/openrlhf/gpu_stand_ins): "
                       "packed samples and ring attention need a GPU")
