package state

import (
	"net/netip"
	"testing"
)

func TestAddrIndex(t *testing.T) {
	x := make(addrIndex[int])
	v4, mapped, v6 := netip.MustParseAddr("10.0.0.1"), netip.MustParseAddr("::ffff:10.0.0.1"), netip.MustParseAddr("fd00::1")
	x.set("", v4, 1)
	x.set("", mapped, 2)
	x.set("", v6, 3)
	x.set("net2", v4, 4)
	x.set("", netip.Addr{}, 5) // ignored
	for _, c := range []struct {
		network string
		ip      netip.Addr
		want    int
	}{{"", v4, 1}, {"", mapped, 2}, {"", v6, 3}, {"net2", v4, 4}, {"net2", v6, 0}, {"net3", v4, 0}, {"", netip.Addr{}, 0}, {"", netip.IPv6Unspecified(), 0}} {
		if got := x.get(c.network, c.ip); got != c.want {
			t.Errorf("get(%q, %v) = %d, want %d", c.network, c.ip, got, c.want)
		}
	}
	count := func(x addrIndex[int]) int {
		n := 0
		for _, l := range x.lens() {
			n += l[0] + l[1]
		}
		return n
	}
	if count(x) != 4 {
		t.Errorf("%d addresses, want 4", count(x))
	}
	x.delete("net2", v4)
	if _, ok := x["net2"]; ok {
		t.Error("an emptied network's table stays")
	}

	// A copy has the entries; shrinking a copy leaves the original's tables alone.
	c := x.clone(addrCount{"": {1000, 0}, "net9": {0, 10}})
	if c.get("", v6) != 3 || c["net9"] == nil {
		t.Fatalf("clone lost entries or a network the batch brings")
	}
	c.delete("", v4)
	c.delete("", mapped)
	s := c.shrunk(map[string][2]int{"": {1000, 2}}) // what it had before a big removal
	if s[""] == c[""] || s.get("", v6) != 3 || count(s) != 1 {
		t.Errorf("shrunk: table replaced %v, %d addresses", s[""] != c[""], count(s))
	}
	if x.get("", v4) != 1 {
		t.Error("changing a clone changed the original")
	}
}
