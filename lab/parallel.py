"""A run's processes under torchrun (`Dist`: rank and world size, the process group, one decision
all ranks agree on); how a training run spreads the model over them (`train.parallel`, chosen once), what
activation checkpointing adds (`train.activation_checkpointing`), and how a checkpoint's full state
is read from and written into the model and optimizer whatever the parallelism.

- ddp: DistributedDataParallel. Every process holds the whole model, its gradients and AdamW's two
  moments (16 bytes per parameter before activations; DDP's all-reduce buckets add a gradient-sized
  copy); gradients are all-reduced during the backward.
- fsdp: FSDP2 (torch.distributed.fsdp.fully_shard, what torchtitan is built on). Each block, then the
  rest (embeddings, final norm, head), is one group whose parameters, gradients and AdamW state are
  split by rows across the processes: each holds 1/world of them. A group's whole parameters are
  all-gathered just before its forward (and again before its backward) and freed after; gradients are
  reduce-scattered to their owners. With bf16 (GPUs that have it) the mixed-precision policy computes
  in bf16 and keeps fp32 master weights, fp32 gradient reductions and an fp32 optimizer.
- One process: neither; the model as it is (`fsdp` with one process has nothing to shard).
Counts of what each holds per GPU: counting.per_gpu_bytes (tools/cost.py prints them).

Checkpoints are one format whatever wrote them: the full (unsharded) weights and the optimizer state
in torch.optim's own layout, integer ids in the order of the optimizer's groups, exactly what
`model.state_dict()` and `optimizer.state_dict()` of a one-process run hold. Under FSDP every rank
takes part in gathering them (torch.distributed.checkpoint.state_dict, full_state_dict with
cpu_offload) and rank 0 alone receives them, in CPU memory, and writes the file as before (atomic).
Every reader (sample.py, tools/visualize.py, tools/export.py, a resume in one process or under DDP,
an FSDP resume with another number of processes) reads it unchanged: that is why this route and not a
sharded checkpoint (torch.distributed.checkpoint.save, one file per rank), which each reader would
have to convert. Its limit: rank 0's CPU memory must hold the full weights and AdamW state (12 bytes
per parameter, ~16 GB at 1.3B), and on resume every process reads the whole file, as under DDP.
"""
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from rules import UserError

log = logging.getLogger("attnlab")

PARALLEL = ("ddp", "fsdp")
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # what checkpoint_wrapper adds to a parameter's name


# ----------------------------------------------------------------------------- processes

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device_name: str = None  # the device this rank must use, where torchrun decides it

    @property
    def master(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str) -> Dist:
    """Rank and world size from torchrun's environment, and a process group if world > 1 (NCCL
    with one GPU per process when the run is on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and (device_name == "auto" or str(device_name).startswith("cuda"))
    if use_cuda:
        torch.cuda.set_device(local_rank)  # under torchrun, cuda:N names nothing: each rank has its own GPU
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, f"cuda:{local_rank}" if use_cuda else None)


def all_ranks_agree(flag: bool, device, world: int) -> bool:
    """True on every rank if `flag` is true on any (one all-reduce; the flag itself without DDP)."""
    if world == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ----------------------------------------------------------------------------- the model over them

def load_weights(model, weights: dict):
    """load_state_dict, with shape mismatches named in one line instead of a traceback. A zero sink logit
    of a layer that takes no sink is left out: older versions registered one, never trained, on every
    layer of a hybrid with model.attn.sink=learned, recurrent layers included."""
    own = model.state_dict()
    weights = {name: t for name, t in weights.items()
               if name in own or not (name.endswith(".attn.sink_logit") and not t.any())}
    for name, tensor in weights.items():
        if name in own and own[name].shape != tensor.shape:
            raise UserError(f"checkpoint does not fit this model: {name} is {tuple(tensor.shape)} in the "
                            f"checkpoint but {tuple(own[name].shape)} here (different n_embd/vocab/...)")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(f"checkpoint does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")


def checkpoint_blocks(model):
    """Activation checkpointing: each block keeps only its input for the backward and recomputes its
    forward there (Chen et al. 2016, arXiv 1604.06174): a block's activations (~18 numbers per token
    and model width at GPT-2's shape, counting.activation_numbers) are held for one block at a time,
    for about one more forward of compute. torch.utils.checkpoint (use_reentrant=False) through
    checkpoint_wrapper, which restores the RNG for the recomputation (the same dropout masks) and keeps
    the state dict's names, so checkpoints are the same files. Wrap before DDP or FSDP."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block)
    return model


class Replicated:
    """One process, or DDP over several: every process holds the whole model, so its own state dicts
    are the checkpoint's."""

    collective_forward = False  # a forward on one rank alone (rank 0's probe) needs no other rank
    shards = 1  # each process holds the whole of the weights, gradients and optimizer state

    def __init__(self, dist_, rt):
        self.world, self.rt = dist_.world, rt

    def wrap(self, model) -> nn.Module:
        """What training steps run through: the model, or DDP around it."""
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[self.rt.device.index] if self.rt.device.type == "cuda" else None)

    def model_state(self, model) -> dict:
        return model.state_dict()

    def optimizer_state(self, model, optimizer) -> dict:
        return optimizer.state_dict()

    def load_model(self, model, weights: dict):
        load_weights(model, weights)

    def load_optimizer(self, model, optimizer, state: dict):
        optimizer.load_state_dict(state)


class FullyShard:
    """FSDP2 over every process: each block one group, then the root (module docstring)."""

    collective_forward = True  # every forward all-gathers each group from every rank: all ranks run it

    def __init__(self, dist_, rt):
        if rt.dtype == torch.float16:
            raise UserError("train.parallel=fsdp computes in bf16 (or fp32) through FSDP's mixed-precision policy; "
                            "fp16 would need a sharded grad scaler, not done here: pass dtype=float32, or "
                            "train.parallel=ddp (fp16 with a grad scaler)")
        self.world, self.rt = dist_.world, rt
        self.shards = dist_.world  # each process holds 1/world of the weights, gradients and optimizer state

    def wrap(self, model) -> nn.Module:
        """Shard `model` in place (its parameters become DTensors, each rank holding its rows): every
        block, then the root. Returns it: it is also what training steps run through."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.rt.device.type, (self.world,))
        # bf16 compute, fp32 master weights (the sharded parameters) and fp32 gradient reduce-scatters
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if self.rt.dtype == torch.bfloat16 else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)  # the root: embeddings, final norm, head
        return model

    def model_state(self, model) -> dict:
        """The full weights, gathered to rank 0's CPU memory (every rank must call it; {} elsewhere). A
        tied weight (wte = lm_head) comes back as two copies: tied again, as model.state_dict() has it
        (the file holds it once)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        first = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            name = name.replace(CHECKPOINT_PREFIX, "")
            if name in state:
                state[name] = state[first.setdefault(id(p), name)]
        return state

    def optimizer_state(self, model, optimizer) -> dict:
        """The full optimizer state on rank 0 (every rank must call it; {} elsewhere), in torch.optim's
        own layout: what a one-process run's optimizer.state_dict() holds."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
        state = get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return by_id(state) if state.get("param_groups") else {}

    def load_model(self, model, weights: dict):
        """Each rank keeps its rows of the full weights (every rank holds them: it read the checkpoint;
        check_resumable has made sure they are this model's)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        # a copy: the loader fills the dict it is given with this rank's shards
        set_model_state_dict(model, dict(weights), options=StateDictOptions(full_state_dict=True))

    def load_optimizer(self, model, optimizer, state: dict):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, by_name(state, model, optimizer),
                                 options=StateDictOptions(full_state_dict=True))
        for group, saved in zip(optimizer.param_groups, state["param_groups"]):  # as load_state_dict leaves them:
            group.update({k: v for k, v in saved.items() if k != "params"})  # its loader made betas a list


def parallelism(tcfg, dist_, rt):
    """The one choice of `train.parallel` for this run: FullyShard under FSDP with several processes,
    else Replicated (one process, or DDP)."""
    if tcfg.parallel == "fsdp" and dist_.world == 1:
        log.info("train.parallel=fsdp with one process: nothing to shard, the model trains as it is")
    return FullyShard(dist_, rt) if tcfg.parallel == "fsdp" and dist_.world > 1 else Replicated(dist_, rt)


# ----------------------------------------------------------------------------- optimizer state layouts

def by_id(state: dict) -> dict:
    """torch.distributed.checkpoint's optimizer state (keyed by parameter name) in torch.optim's own
    layout: integer ids counted through the groups' parameters in order, state in id order."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    ids = {name: i for i, name in enumerate(order)}
    return {"state": {ids[name]: state["state"][name] for name in order if name in state["state"]},
            "param_groups": [{**group, "params": [ids[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def by_name(state: dict, model, optimizer) -> dict:
    """The reverse of by_id for this optimizer: each id is the name of the optimizer's id-th parameter."""
    if set(state) != {"state", "param_groups"}:
        raise UserError("the checkpoint's optimizer state is not AdamW's (another train.optimizer?); resume with "
                        "the run's own train.optimizer")
    names = {p: name.replace(CHECKPOINT_PREFIX, "") for name, p in model.named_parameters()}
    order = [names[p] for group in optimizer.param_groups for p in group["params"]]
    if len(order) != sum(len(g["params"]) for g in state["param_groups"]):
        raise UserError(f"the checkpoint's optimizer holds {sum(len(g['params']) for g in state['param_groups'])} "
                        f"parameters but this run's {len(order)}: resume with the run's own config")
    return {"state": {order[i]: dict(s) for i, s in state["state"].items()},  # copies: the loader fills them
            "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                             for group in state["param_groups"]]}

