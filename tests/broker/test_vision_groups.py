"""The choices of one image request share one encode: the first member leads, the others wait for
its embeddings or, arriving later, take them from the group until all have come; a follower fails
with its leader, even one that comes after the failure; a cancelled leader hands over to its first follower; members must carry the same
images, and groups of different clients never mix."""
import numpy as np
import pytest
from pydantic import ValidationError

from moebus.broker.vision_groups import ImageGroups, image_keys
from moebus.common import protocol as p
from moebus.common import wire


class _Seq:
    def __init__(self, client: bytes):
        self.client = client


class _Req:
    def __init__(self, group="g", size=3, images=(b"cat",), client=b"c1"):
        self.seq, self.group, self.group_size = _Seq(client), group, size
        self.keys = image_keys([np.frombuffer(data, np.uint8) for data in images])


def test_the_leader_encodes_and_every_member_takes_its_embeddings_once():
    groups = ImageGroups()
    leader, early, late = _Req(), _Req(), _Req()
    assert groups.join(leader) is None  # it leads: it will encode
    assert groups.join(early).embeds is None and groups.followers() == [early]
    embeds = np.ones((4, 2), np.float32)
    assert groups.encoded(leader, embeds) == [early]
    assert not embeds.flags.writeable  # shared by three sequences
    group = groups.join(late)
    assert group.embeds is embeds
    groups.take(group)
    assert groups.groups == {}  # all three came: closed


def test_a_follower_fails_with_its_leader_and_a_cancelled_leader_hands_over():
    groups = ImageGroups()
    leader, first, second = _Req(), _Req(), _Req()
    for req in (leader, first, second):
        groups.join(req)
    assert groups.cancelled(leader) is first  # first now leads, second follows it
    assert groups.followers() == [second]
    assert groups.failed(first, {"message": "bad image"}) == [second] and groups.groups == {}
    leader, late = _Req(size=2), _Req(size=2)
    groups.join(leader)
    assert groups.failed(leader, {"message": "bad image"}) == []
    group = groups.join(late)  # it comes after the failure: it gets the same error
    assert group.error == {"message": "bad image"} and group.embeds is None
    groups.take(group)
    assert groups.groups == {}
    lone = _Req(size=2)
    groups.join(lone)
    assert groups.cancelled(lone) is None and groups.groups == {}  # no follower: the group is gone


def test_members_must_carry_the_same_images_and_clients_never_mix():
    groups = ImageGroups()
    leader = _Req()
    groups.join(leader)
    assert groups.join(_Req(images=(b"dog",))) is None and groups.followers() == []  # encodes on its own
    assert groups.join(_Req(client=b"c2")) is None  # leads a group of its own client
    assert len(groups.groups) == 2
    assert groups.join(_Req(group=None)) is None and groups.join(_Req(size=1)) is None  # no group at all
    assert len(groups.groups) == 2
    assert groups.join(_Req()) is not None and groups.join(_Req()) is not None  # the group's size: 3
    assert groups.join(_Req()) is None and len(groups.followers()) == 2  # a fourth waits on its own


def test_an_encoded_group_whose_last_members_never_come_expires():
    groups = ImageGroups()
    leader = _Req()
    groups.join(leader)
    groups.encoded(leader, np.zeros((1, 1), np.float32))
    group = next(iter(groups.groups.values()))
    groups.expire(group.expires_s - 1)
    assert groups.groups
    groups.expire(group.expires_s + 1)
    assert groups.groups == {}


def test_generate_carries_its_image_group_over_the_wire():
    msg = p.Generate(id="r-1", messages=[{"role": "user", "content": [{"type": "image"}]}],
                     images=[np.frombuffer(b"\x89PNG", np.uint8)], image_group="chatcmpl-1", image_group_size=3)
    back = wire.decode([bytes(f) for f in wire.encode(msg)])
    assert (back.image_group, back.image_group_size) == ("chatcmpl-1", 3)
    assert (p.Generate(id="r", prompt="x").image_group, p.Generate(id="r", prompt="x").image_group_size) == (None, 1)
    for bad in ({"image_group_size": 0}, {"image_group_size": 17}, {"image_group": ""}):
        with pytest.raises(ValidationError):
            p.Generate(id="r", prompt="x", **bad)


def test_finished_groups_held_for_late_members_are_bounded():
    from moebus.broker.vision_groups import MAX_DONE_GROUPS

    groups = ImageGroups()
    leaders = [_Req(group=f"g{i}", size=16) for i in range(MAX_DONE_GROUPS + 5)]
    for leader in leaders:  # each finishes with 15 members still to come, which never do
        groups.join(leader)
        groups.encoded(leader, np.ones((4, 2), np.float32))
    assert len(groups.groups) == MAX_DONE_GROUPS
    assert ("c1".encode(), "g0") not in groups.groups and (b"c1", f"g{len(leaders) - 1}") in groups.groups
    late = _Req(group="g0", size=16)
    assert groups.join(late) is None  # its group went: it leads one of its own and encodes again
