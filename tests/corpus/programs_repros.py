"""Programs from PyTorch's test/dynamo/test_repros.py (ReproTests): code from real models
(detectron2, HuggingFace, timm, maml) that the repro tests compile, with the helper classes
and functions of that file. Model sizes are cut down where the test used large inputs."""
# ruff: noqa: F841
from __future__ import annotations

import collections
import inspect
from abc import ABC
from collections import namedtuple
from copy import deepcopy
from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from . import In, program, r, t


# pytorch test/dynamo/test_repros.py::ReproTests::test_do_paste_mask
@program(In(r(1, 1, 28, 28, seed=1), t(0.0, 1, 2, 4).view(1, 4) * 1, 427, 640, True),
         In(r(1, 1, 28, 28, seed=2), t(0.0, 1, 2, 4).view(1, 4) * 3, 612, 612, True),
         In(r(1, 1, 28, 28, seed=3), t(0.0, 1, 2, 4).view(1, 4) * 2, 20, 24, False))
def do_paste_mask(masks, boxes, img_h: int, img_w: int, skip_empty: bool = True):
    # from detectron2 mask_ops.py
    device = masks.device

    if skip_empty and not torch.jit.is_scripting():
        x0_int, y0_int = torch.clamp(boxes.min(dim=0).values.floor()[:2] - 1, min=0).to(dtype=torch.int32)
        x1_int = torch.clamp(boxes[:, 2].max().ceil() + 1, max=img_w).to(dtype=torch.int32)
        y1_int = torch.clamp(boxes[:, 3].max().ceil() + 1, max=img_h).to(dtype=torch.int32)
    else:
        x0_int, y0_int = 0, 0
        x1_int, y1_int = img_w, img_h
    x0, y0, x1, y1 = torch.split(boxes, 1, dim=1)  # each is Nx1

    N = masks.shape[0]

    img_y = torch.arange(y0_int, y1_int, device=device, dtype=torch.float32) + 0.5
    img_x = torch.arange(x0_int, x1_int, device=device, dtype=torch.float32) + 0.5
    img_y = (img_y - y0) / (y1 - y0) * 2 - 1
    img_x = (img_x - x0) / (x1 - x0) * 2 - 1

    gx = img_x[:, None, :].expand(N, img_y.size(1), img_x.size(1))
    gy = img_y[:, :, None].expand(N, img_y.size(1), img_x.size(1))
    grid = torch.stack([gx, gy], dim=3)

    if not torch.jit.is_scripting():
        if not masks.dtype.is_floating_point:
            masks = masks.float()
    img_masks = F.grid_sample(masks, grid.to(masks.dtype), align_corners=False)

    if skip_empty and not torch.jit.is_scripting():
        return img_masks[:, 0], (slice(y0_int, y1_int), slice(x0_int, x1_int))
    else:
        return img_masks[:, 0], ()


def cat(tensors, dim=0):
    # from detectron2 wrappers.py
    assert isinstance(tensors, (list, tuple))
    if len(tensors) == 1:
        return tensors[0]
    return torch.cat(tensors, dim)


def shapes_to_tensor(x, device=None):
    # from detectron2 wrappers.py
    if torch.jit.is_scripting():
        return torch.as_tensor(x, device=device)
    if torch.jit.is_tracing():
        assert all([isinstance(t, torch.Tensor) for t in x]), "Shape should be tensor during tracing!"
        ret = torch.stack(x)
        if ret.device != device:
            ret = ret.to(device=device)
        return ret
    return torch.as_tensor(x, device=device)


class Boxes:
    # from detectron2 poolers.py
    def __init__(self, tensor: torch.Tensor):
        device = tensor.device if isinstance(tensor, torch.Tensor) else torch.device("cpu")
        tensor = torch.as_tensor(tensor, dtype=torch.float32, device=device)
        if tensor.numel() == 0:
            tensor = tensor.reshape((-1, 4)).to(dtype=torch.float32, device=device)
        assert tensor.dim() == 2 and tensor.size(-1) == 4, tensor.size()
        self.tensor = tensor

    def __len__(self) -> int:
        return self.tensor.shape[0]

    @property
    def device(self):
        return self.tensor.device


# pytorch test/dynamo/test_repros.py::ReproTests::test_convert_boxes_to_pooler_format
@program(In([Boxes(torch.arange(0, 8).reshape((2, 4))), Boxes(torch.arange(8, 16).reshape((2, 4)))]),
         In([Boxes(torch.arange(16, 20).reshape((1, 4))), Boxes(torch.arange(20, 24).reshape((1, 4)))]),
         In([Boxes(torch.arange(0, 12).reshape((3, 4)))]))
def convert_boxes_to_pooler_format(box_lists):
    # from detectron2 structures.py
    boxes = torch.cat([x.tensor for x in box_lists], dim=0)
    sizes = shapes_to_tensor([x.__len__() for x in box_lists], device=boxes.device)
    indices = torch.repeat_interleave(torch.arange(len(box_lists), dtype=boxes.dtype, device=boxes.device), sizes)
    return cat([indices[:, None], boxes], dim=1)


# pytorch test/dynamo/test_repros.py::ReproTests::test_boxes_len
@program(In(Boxes(torch.arange(0, 8).reshape((2, 4)))), In(Boxes(torch.arange(0, 12).reshape((3, 4)))))
def boxes_len(boxes):
    return len(boxes) + boxes.__len__() + boxes.tensor


class _ReversibleFunction(torch.autograd.Function):
    # taken from modeling_reformer.py in huggingface
    @staticmethod
    def forward(ctx, hidden_states, layers, attention_mask, head_mask, num_hashes, all_hidden_states,
                all_attentions, past_buckets_states, use_cache, orig_sequence_length, output_hidden_states,
                output_attentions):
        all_buckets = ()
        hidden_states, attn_output = torch.chunk(hidden_states, 2, dim=-1)
        for layer_id, (layer, layer_head_mask) in enumerate(zip(layers, head_mask)):
            if output_hidden_states is True:
                all_hidden_states.append(hidden_states)
            attn_output = layer(attn_output)
        if output_hidden_states is True:
            all_hidden_states.append(hidden_states)
        ctx.save_for_backward(attn_output.detach(), hidden_states.detach())
        ctx.layers = layers
        ctx.all_buckets = all_buckets
        ctx.head_mask = head_mask
        ctx.attention_mask = attention_mask
        return torch.cat([attn_output, hidden_states], dim=-1)

    @staticmethod
    def backward(ctx, grad_hidden_states):  # not exercised here
        raise NotImplementedError


ReformerEncoderOutput = namedtuple(
    "ReformerEncoderOutput", ["hidden_states", "all_hidden_states", "all_attentions", "past_buckets_states"]
)


# pytorch test/dynamo/test_repros.py::ReproTests::test_reformer_eval
@program(In(r(1, 4, 256, seed=1)).no_grad(), In(r(2, 3, 256, seed=2)).no_grad(),
         In(r(1, 4, 256, seed=3), output_hidden_states=True).no_grad(), random=True, flip="eval")
class ReformerEncoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dropout = 0.5
        self.layer_norm = torch.nn.LayerNorm(512, eps=1.0e-12)
        self.layers = [torch.nn.Linear(256, 256)]

    def forward(self, hidden_states, attention_mask=None, head_mask=[None] * 6, num_hashes=None,
                use_cache=False, orig_sequence_length=64, output_hidden_states=False, output_attentions=False):
        all_hidden_states = []
        all_attentions = []
        past_buckets_states = [((None), (None)) for i in range(len(self.layers))]
        hidden_states = torch.cat([hidden_states, hidden_states], dim=-1)
        hidden_states = _ReversibleFunction.apply(
            hidden_states, self.layers, attention_mask, head_mask, num_hashes, all_hidden_states,
            all_attentions, past_buckets_states, use_cache, orig_sequence_length, output_hidden_states,
            output_attentions,
        )
        hidden_states = self.layer_norm(hidden_states)
        hidden_states = torch.nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        return ReformerEncoderOutput(
            hidden_states=hidden_states,
            all_hidden_states=all_hidden_states,
            all_attentions=all_attentions,
            past_buckets_states=past_buckets_states,
        )


# pytorch test/dynamo/test_repros.py::ReproTests::test_longformer_chunk (window_overlap passed smaller)
@program(In(r(1, 16, 1, seed=1), 4), In(r(3, 16, 2, seed=2), 4), In(r(1, 12, 1, seed=3), 3))
def longformer_chunk(hidden_states, window_overlap=256):
    """convert into overlapping chunks. Chunk size = 2w, overlap size = w"""
    hidden_states = hidden_states.view(
        hidden_states.size(0),
        hidden_states.size(1) // (window_overlap * 2),
        window_overlap * 2,
        hidden_states.size(2),
    )
    chunk_size = list(hidden_states.size())
    chunk_size[1] = chunk_size[1] * 2 - 1
    chunk_stride = list(hidden_states.stride())
    chunk_stride[1] = chunk_stride[1] // 2
    return hidden_states.as_strided(size=chunk_size, stride=chunk_stride)


# pytorch test/dynamo/test_repros.py::ReproTests::test_hf_t5_forward
@program(In(r(1, 4, 512, seed=1)), In(r(1, 3, 512, seed=2), key_value_states=r(1, 5, 512, seed=3)),
         In(r(1, 2, 512, seed=4), past_key_value=(r(1, 8, 3, 64, seed=5), r(1, 8, 3, 64, seed=6))))
class PartialT5(torch.nn.Module):
    # Highly simplified T5Attention prefix
    def __init__(self):
        super(PartialT5, self).__init__()
        self.q = torch.nn.Linear(512, 512)
        self.k = torch.nn.Linear(512, 512)
        self.v = torch.nn.Linear(512, 512)

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, query_length=None):
        batch_size, seq_length = hidden_states.shape[:2]

        real_seq_length = seq_length

        if past_key_value is not None:
            assert len(past_key_value) == 2, (
                f"past_key_value should have 2 past states: keys and values. Got {len(past_key_value)} past states"
            )
            real_seq_length += past_key_value[0].shape[2] if query_length is None else query_length

        def shape(states):
            """projection"""
            return states.view(batch_size, -1, 8, 64).transpose(1, 2)

        def project(hidden_states, proj_layer, key_value_states, past_key_value):
            """projects hidden states correctly to key/query states"""
            if key_value_states is None:
                hidden_states = shape(proj_layer(hidden_states))
            elif past_key_value is None:
                hidden_states = shape(proj_layer(key_value_states))

            if past_key_value is not None:
                if key_value_states is None:
                    hidden_states = torch.cat([past_key_value, hidden_states], dim=2)
                else:
                    hidden_states = past_key_value
            return hidden_states

        query_states = shape(self.q(hidden_states))
        key_states = project(hidden_states, self.k, key_value_states,
                             past_key_value[0] if past_key_value is not None else None)
        value_states = project(hidden_states, self.v, key_value_states,
                               past_key_value[1] if past_key_value is not None else None)
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        return scores, value_states


# pytorch test/dynamo/test_repros.py::ReproTests::test_slicing_dynamic_shape
@program(In(torch.ones(10, dtype=torch.long)), In(t(4, dtype=torch.long)), In(t(6, 1, dtype=torch.long)))
def slicing_dynamic_shape(y):
    x = torch.ones(8)
    idx = y[0]
    out = x[idx:]
    return (out + 3) * 5


# pytorch test/dynamo/test_repros.py::ReproTests::test_slicing_dynamic_shape_setitem
@program(In(torch.tensor([0, 1, 2, 5, 0, 1, 2, 3, 4, 5]), r(10, 8, seed=1)),
         In(torch.tensor([0, 1, 2, 2, 0, 1, 2, 3, 4, 5]), r(10, 8, seed=2)))
def slicing_dynamic_shape_setitem(input_lengths: torch.Tensor, new_ones_1):
    getitem_13 = input_lengths[3]
    new_ones_1[(3, slice(getitem_13, None, None))] = 0
    setitem_13 = new_ones_1
    return (setitem_13,)


def apply_chunking_to_forward(forward_fn, *input_tensors):
    # simplified from HF model_utils.py
    assert len(input_tensors) > 0
    tensor_shape = input_tensors[0].shape[1]
    assert all(input_tensor.shape[1] == tensor_shape for input_tensor in input_tensors)
    num_args_in_forward_chunk_fn = len(inspect.signature(forward_fn).parameters)
    if num_args_in_forward_chunk_fn != len(input_tensors):
        raise ValueError()
    return forward_fn(*input_tensors)


# pytorch test/dynamo/test_repros.py::ReproTests::test_chunk_reformer_ff
@program(In(r(1, 8, 256, seed=1)), In(r(2, 3, 256, seed=2)))
class ChunkReformerFeedForward(torch.nn.Module):
    # simplified from HF modeling_reformer.py
    def __init__(self):
        super().__init__()
        self.layer_norm = torch.nn.LayerNorm(256, eps=1e-12)
        self.dense = torch.nn.Linear(256, 256)
        self.output = torch.nn.Linear(256, 256)

    def forward(self, attention_output):
        return apply_chunking_to_forward(self.forward_chunk, attention_output + 1)

    def forward_chunk(self, hidden_states):
        hidden_states = self.layer_norm(hidden_states)
        hidden_states = self.dense(hidden_states)
        return self.output(hidden_states)


class FakeMamlInner(torch.nn.Module):
    def __init__(self):
        super(FakeMamlInner, self).__init__()
        self.linear = torch.nn.Linear(784, 5)

    def forward(self, x, ignored=None, bn_training=False):
        return self.linear(x.view(x.shape[0], -1))


# pytorch test/dynamo/test_repros.py::ReproTests::test_maml_no_item_capture
@program(In(r(5, 1, 28, 28, seed=1), torch.zeros(5, dtype=torch.int64), r(7, 1, 28, 28, seed=2),
            torch.zeros(7, dtype=torch.int64)),
         In(r(5, 1, 28, 28, seed=3), torch.arange(5) % 5, r(4, 1, 28, 28, seed=4), torch.arange(4) % 5))
class PartialMaml(torch.nn.Module):
    # Highly simplified version of maml.meta.Meta.finetuning
    def __init__(self):
        super(PartialMaml, self).__init__()
        self.net = FakeMamlInner()
        self.update_step_test = 10
        self.update_lr = 0.4

    def forward(self, x_spt, y_spt, x_qry, y_qry):
        querysz = x_qry.size(0)

        corrects = [0 for _ in range(self.update_step_test + 1)]

        # in order to not ruin the state of running_mean/variance and bn_weight/bias
        # we finetunning on the copied model instead of self.net
        net = deepcopy(self.net)

        # 1. run the i-th task and compute loss for k=0
        logits = net(x_spt)
        loss = F.cross_entropy(logits, y_spt)
        grad = torch.autograd.grad(loss, net.parameters())
        fast_weights = list(map(lambda p: p[1] - self.update_lr * p[0], zip(grad, net.parameters())))

        # this is the loss and accuracy before first update
        with torch.no_grad():
            logits_q = net(x_qry, net.parameters(), bn_training=True)
            pred_q = F.softmax(logits_q, dim=1).argmax(dim=1)
            correct = torch.eq(pred_q, y_qry).sum().item()
            corrects[0] = corrects[0] + correct

        # this is the loss and accuracy after the first update
        with torch.no_grad():
            logits_q = net(x_qry, fast_weights, bn_training=True)
            pred_q = F.softmax(logits_q, dim=1).argmax(dim=1)
            correct = torch.eq(pred_q, y_qry).sum().item()
            corrects[1] = corrects[1] + correct

        del net

        accs = torch.tensor(corrects) / querysz

        return accs


class ModelOutput(collections.OrderedDict):
    """based on file_utils.py in HuggingFace"""

    def __getitem__(self, k):
        if isinstance(k, str):
            inner_dict = {k: v for (k, v) in self.items()}
            return inner_dict[k]
        else:
            return self.to_tuple()[k]

    def __setattr__(self, name, value):
        if name in self.keys() and value is not None:
            super().__setitem__(name, value)
        super().__setattr__(name, value)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def to_tuple(self):
        return tuple(self[k] for k in self.keys())


# pytorch test/dynamo/test_repros.py::ReproTests::test_hf_model_output (fn2, fn4)
@program(In(ModelOutput(a=r(10, seed=1), b=r(10, seed=2), c=r(10, seed=3))),
         In(ModelOutput(a=r(3, seed=4), b=r(3, seed=5))))
def hf_model_output(x):
    return x.a + 1, x[0] + 1, x["b"]


# pytorch test/dynamo/test_repros.py::ReproTests::test_create_rand_mask_from_inputs (smaller)
@program(In(r(1, 8, 4, seed=1), r(1, 8, 4, seed=2), torch.zeros([1, 2, 6, 3], dtype=torch.int64), 2, 3, 1, 32, 4),
         In(r(1, 8, 4, seed=3), r(1, 8, 4, seed=4), torch.ones([1, 2, 6, 3], dtype=torch.int64), 2, 3, 1, 32, 4))
def create_rand_mask_from_inputs(from_blocked_mask, to_blocked_mask, rand_attn, num_attention_heads,
                                 num_rand_blocks, batch_size, from_seq_length, from_block_size):
    """taken from HF modeling_big_bird.py"""
    num_windows = from_seq_length // from_block_size - 2
    rand_mask = torch.stack([p1[i1.flatten()] for p1, i1 in zip(to_blocked_mask, rand_attn)])
    rand_mask = rand_mask.view(batch_size, num_attention_heads, num_windows, num_rand_blocks * from_block_size)
    rand_mask = torch.einsum("blq,bhlk->bhlqk", from_blocked_mask[:, 1:-1], rand_mask)
    return rand_mask


# pytorch test/dynamo/test_repros.py::ReproTests::test_rng_state
@program(In(), In(), random=True)
def rng_state():
    state = torch.get_rng_state()
    before = torch.rand(10)
    torch.set_rng_state(state)
    after = torch.rand(10)
    return before, after


class SequentialAppendList(torch.nn.Sequential):
    """from timm/models/vovnet.py"""

    def __init__(self, *args):
        if not args:
            args = (torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10), torch.nn.ReLU())
        super(SequentialAppendList, self).__init__(*args)

    def forward(self, x: torch.Tensor, concat_list: List[torch.Tensor]) -> torch.Tensor:
        for i, module in enumerate(self):
            if i == 0:
                concat_list.append(module(x))
            else:
                concat_list.append(module(concat_list[-1]))
        x = torch.cat(concat_list, dim=1)
        return x, concat_list


_X4 = r(4, 10, seed=1)
_X2 = r(2, 10, seed=2)

# pytorch test/dynamo/test_repros.py::ReproTests::test_seq_append_list
program(In(_X4, [_X4]), In(_X2, [_X2]), In(_X2, [_X2, _X2]), name="seq_append_list",
        origin="test/dynamo/test_repros.py::ReproTests::test_seq_append_list")(SequentialAppendList)


class BatchNormAct2d(torch.nn.BatchNorm2d):
    """Taken from timm"""

    def __init__(self, num_features=1, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True,
                 act_layer=torch.nn.ReLU, inplace=True):
        super(BatchNormAct2d, self).__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                                             track_running_stats=track_running_stats)
        self.act = act_layer(inplace=inplace)

    @torch.jit.ignore
    def _forward_python(self, x):
        return super().forward(x)

    def forward(self, x):
        if torch.jit.is_scripting():
            x = self._forward_jit(x)
        else:
            x = self._forward_python(x)
        x = self.act(x)
        return x


# pytorch test/dynamo/test_repros.py::ReproTests::test_batch_norm_act
program(In(r(5, 1, 4, 4, seed=1)), In(r(2, 1, 3, 3, seed=2)), flip="eval", name="batch_norm_act",
        origin="test/dynamo/test_repros.py::ReproTests::test_batch_norm_act")(BatchNormAct2d)


def get_parameter_dtype(parameter):
    """from huggingface model_utils.py"""
    try:
        return next(parameter.parameters()).dtype
    except StopIteration:

        def find_tensor_attributes(module):
            tuples = [(k, v) for k, v in module.__dict__.items() if torch.is_tensor(v)]
            return tuples

        gen = parameter._named_members(get_members_fn=find_tensor_attributes)
        first_tuple = next(gen)
        return first_tuple[1].dtype


_DTYPE_MODEL = SequentialAppendList(torch.nn.Linear(10, 10), torch.nn.ReLU())
_DTYPE_MODEL64 = SequentialAppendList(torch.nn.Linear(10, 10), torch.nn.ReLU()).double()


# pytorch test/dynamo/test_repros.py::ReproTests::test_get_parameter_dtype
@program(In(_DTYPE_MODEL, r(10, seed=1)), In(_DTYPE_MODEL64, r(10, seed=2)), random=True)
def get_parameter_dtype_fn(model, x):
    return x + torch.randn(10, dtype=get_parameter_dtype(model))


# pytorch test/dynamo/test_repros.py::ReproTests::test_nn_parameter
@program(In(), In(), random=True)
def nn_parameter():
    a = torch.nn.Parameter(torch.randn(5, 5))
    assert isinstance(a, torch.nn.Parameter)
    return a


class DummyConfig:
    attn_layers = ["local", "lsh", "local", "lsh", "local", "lsh"]
    lsh_attn_chunk_length = 64
    local_attn_chunk_length = 64


class LshConfig(DummyConfig):
    attn_layers = ["lsh", "lsh"]
    lsh_attn_chunk_length = 32


def _get_min_chunk_len(config):
    """from hf_Reformer"""
    attn_types = config.attn_layers
    attn_types_set = set(attn_types)
    if len(attn_types_set) == 1 and attn_types[0] == "lsh":
        return config.lsh_attn_chunk_length
    elif len(attn_types_set) == 1 and attn_types[0] == "local":
        return config.local_attn_chunk_length
    elif len(attn_types_set) == 2 and attn_types_set == set(["lsh", "local"]):
        return min(config.lsh_attn_chunk_length, config.local_attn_chunk_length)
    else:
        raise NotImplementedError(
            f"Only attn layer types 'lsh' and 'local' exist, but `config.attn_layers`: {config.attn_layers}. Select "
            "attn layer types from ['lsh', 'local'] only."
        )


# pytorch test/dynamo/test_repros.py::ReproTests::test_reformer_min_chunk_len
@program(In(DummyConfig()), In(LshConfig()))
def reformer_min_chunk_len(cfg):
    t = torch.empty(10)
    t.fill_(_get_min_chunk_len(cfg))
    return t[0]


def _stable_argsort(vector, dim):
    """from hf_Reformer"""
    scale_offset = torch.arange(vector.shape[dim], device=vector.device).view(1, 1, -1)
    scale_offset = scale_offset.expand(vector.shape)
    scaled_vector = vector.shape[dim] * vector + (scale_offset % vector.shape[dim])
    return torch.argsort(scaled_vector, dim=dim)


# pytorch test/dynamo/test_repros.py::ReproTests::test_reformer_sorting
@program(In(torch.zeros([1, 12, 16], dtype=torch.int64)), In(torch.tensor([[[3, 1, 2, 1, 0, 3]]])))
def get_sorted_bucket_idx_and_undo_sorted_bucket_idx(buckets):
    """from hf_Reformer"""
    with torch.no_grad():
        sorted_bucket_idx = _stable_argsort(buckets, dim=-1)
        indices = (
            torch.arange(sorted_bucket_idx.shape[-1], device=buckets.device)
            .view(1, 1, -1)
            .expand(sorted_bucket_idx.shape)
        )
        undo_sorted_bucket_idx = sorted_bucket_idx.new(*sorted_bucket_idx.size())
        undo_sorted_bucket_idx.scatter_(-1, sorted_bucket_idx, indices)

    return sorted_bucket_idx, undo_sorted_bucket_idx


def _recursive_map(struct, batch_dim=0):
    for k, v in struct.items():
        if v is not None:
            if isinstance(v, dict):
                _recursive_map(v)
            else:
                struct[k] = v


# pytorch test/dynamo/test_repros.py::ReproTests::test_recursive_map
@program(In(r(10, seed=1), r(10, seed=2), {"layer0": {"memory_keys": r(10, seed=3)}}),
         In(r(3, seed=4), r(3, seed=5), None), In(r(3, seed=6), r(3, seed=7), {"a": None, "b": {"c": 1}}))
def recursive_map(a, b, v):
    x = a / (torch.abs(a) + 1)
    if v is not None:
        _recursive_map(v)
    return x * b


class FeedForwardLayer(nn.Module):
    def __init__(self, d_model, dim_feedforward, activation, dropout) -> None:
        super(FeedForwardLayer, self).__init__()
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.activation = activation
        self.dropout1 = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout2(self.linear2(self.dropout1(self.activation(self.linear1(x)))))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model=64, nhead=2, dim_feedforward=128, dropout=0.1, activation=nn.ReLU(),
                 layer_norm_eps=1e-5):
        super(TransformerEncoderLayer, self).__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.norm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout = nn.Dropout(dropout)
        self.ff_block = FeedForwardLayer(d_model, dim_feedforward, activation, dropout)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        x = src
        x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask))
        x = self.norm2(x + self._ff_block(x))
        return x

    def _sa_block(self, x, attn_mask, key_padding_mask):
        x = self.self_attn(x, x, x, attn_mask=attn_mask, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return self.dropout(x)

    def _ff_block(self, x):
        return self.ff_block(x)


# pytorch test/dynamo/test_repros.py::ReproTests::test_issue175 (dim_feedforward 128 instead of 2048)
program(In(r(1, 64, seed=1)), In(r(3, 64, seed=2)), random=True, flip="eval", name="issue175",
        origin="test/dynamo/test_repros.py::ReproTests::test_issue175")(TransformerEncoderLayer)


def _reversible(x):
    return torch.sin(torch.cos(x))


# pytorch test/dynamo/test_repros.py::ReproTests::test_with_on_graph_break_inst
@program(In(r(3, seed=1, requires_grad=True)).no_grad(), In(r(4, seed=2, requires_grad=True)).no_grad())
def with_on_graph_break_inst(x):
    with torch.enable_grad():
        a = torch.sin(x)
        b = _reversible(a)
        c = torch.sigmoid(b)
        c.sum().backward()
        return x.grad


# pytorch test/dynamo/test_repros.py::ReproTests::test_grad_mode_carrying_correct_state_after_graph_break
@program(In(r(3, seed=1, requires_grad=True)), In(r(3, seed=2)), In(r(2, seed=3, requires_grad=True)).no_grad())
def grad_mode_carrying_correct_state_after_graph_break(x):
    with torch.no_grad():
        y = x * 3
        z = x + 2
    return y, z, x * 4


class BaseModule(torch.nn.Module, ABC):
    def blah(self, x):
        return x + 1


# pytorch test/dynamo/test_repros.py::ReproTests::test_abc_setattr
@program(In(r(3, seed=1, requires_grad=True)), In(r(2, seed=2)))
class Derived(BaseModule):
    def __setattr__(self, name, value) -> None:
        super().__setattr__(name, value)

    def forward(self, x):
        self.foo = 0
        return self.blah(x)

    def blah(self, x):
        return super().blah(x)


# pytorch test/dynamo/test_repros.py::ReproTests::test_guard_fail_nested_tuple
@program(In((torch.ones(1), (torch.ones(1), torch.ones(1)))), In((torch.ones(1), torch.ones(1))),
         In((r(2, seed=1), [r(2, seed=2)])))
def guard_fail_nested_tuple(args):
    return torch.ones(()), args[0] * 2


class _TestModule(torch.nn.Module):
    def inner_fn(self, left, right):
        return tuple(left) == tuple(right)

    def fn(self, tensor):
        if type(tensor) is int:
            return False

        torch.add(tensor, tensor)
        return self.inner_fn(tensor.shape, (1, 2, 3))


# pytorch test/dynamo/test_repros.py::ReproTests::test_guard_ordering_shape_fail
@program(In(torch.zeros(1, 2, 3)), In(torch.zeros(3, 2, 1)), In(3), factory=True)
def guard_ordering_shape_fail():
    return _TestModule().fn
