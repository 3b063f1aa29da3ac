"""Key-path utilities (zoo._tree): one home for path names and walking them."""

import jax
import pytest
from jax.tree_util import DictKey, GetAttrKey, SequenceKey

import zoo
from zoo._tree import child, dotted_name, key_path, node_at, path_str


def _model():
    config = zoo.models.TransformerConfig(vocab_size=16, d_model=8, num_heads=2, num_layers=2, mlp_dim=16, max_len=4)
    return zoo.models.Transformer(config, key=jax.random.key(0))


def test_names_of_key_paths():
    path = (GetAttrKey("layers"), SequenceKey(0), DictKey("a"), GetAttrKey("weight"))
    assert path_str(path) == "model.layers[0]['a'].weight"
    assert path_str(path, root="state") == "state.layers[0]['a'].weight"
    assert dotted_name(path) == "layers.0.a.weight"
    assert dotted_name(()) == "" and path_str(()) == "model"


def test_walk_there_and_back():
    model = _model()
    tree = {"model": model, "list": [1, {"x": 2}]}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        assert node_at(tree, path) is leaf
        assert key_path(tree, dotted_name(path)) == path
    (path, _), *_ = jax.tree_util.tree_flatten_with_path(model)[0]
    assert node_at(model, key_path(model, dotted_name(path[:-1]))) is node_at(model, path[:-1])


def test_child_of_an_unfollowable_key():
    key = jax.tree_util.FlattenedIndexKey(0)
    assert child(object(), key, None) is None
    with pytest.raises(TypeError, match="cannot follow path key"):
        child(object(), key)
