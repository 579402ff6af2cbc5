import torch, torch.distributed as dist
from tests.test_context_parallel import _nano_gpt, PLANNED, example_batch, SequenceSplit, apply_context_parallel, measured_activations
import disttrain.parallel.context as ctx
def f(mode):
    torch.set_num_threads(1)
    if mode == "nockpt":
        ctx.SequenceSplit.attend = lambda self, q, k, v, dropout_p=0.0, fp32=None: self._attend(q, k, v, dropout_p, fp32)
    split = SequenceSplit(dist.group.WORLD, dist.get_rank(), dist.get_world_size())
    inputs, targets = (split.split(t) for t in example_batch(PLANNED, 4))
    net = _nano_gpt(); apply_context_parallel(net, split)
    a = measured_activations(net, (inputs, targets))
    x, y = example_batch(PLANNED, 4)
    b = measured_activations(_nano_gpt(), (x[:, :128], y[:, :128]))
    return a, b
