package xds

import (
	"crypto/sha256"
	"encoding/hex"
	"reflect"
	"strings"
	"testing"

	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
)

func TestPackVersion(t *testing.T) {
	sum := sha256.Sum256([]byte("w1"))
	h := hex.EncodeToString(sum[:])
	if v, packed := packVersion(h); !packed || v != string(sum[:]) {
		t.Errorf("packVersion(%s) = %x, %v; want its 32 bytes", h, v, packed)
	}
	for _, v := range []string{"1", h[:63], h + "0", strings.ToUpper(h), h[:63] + "g"} {
		if got, packed := packVersion(v); packed || got != v {
			t.Errorf("packVersion(%q) packed; want it kept as it is", v)
		}
	}
}

// The versions listed on a reconnect are the server's, character for character, whether
// kept packed or not, as a resource's version changes form or the resource goes.
func TestVersionsListedAsSent(t *testing.T) {
	c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://127.0.0.1:1"}}, state.NewStore(), nil)
	if err != nil {
		t.Fatal(err)
	}
	at := func(r *discoverypb.Resource, v string) *discoverypb.Resource { r.Version = v; return r }
	sum := func(s string) string { b := sha256.Sum256([]byte(s)); return hex.EncodeToString(b[:]) }
	push := func(nonce string, removed []string, rs ...*discoverypb.Resource) {
		t.Helper()
		ack := c.handle(&discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: nonce, Resources: rs, RemovedResources: removed})
		if ack.GetErrorDetail() != nil {
			t.Fatal(ack.GetErrorDetail())
		}
	}
	listed := func() map[string]string {
		for _, r := range c.initialRequests() {
			if r.GetTypeUrl() == xdspb.AddressType {
				return r.GetInitialResourceVersions()
			}
		}
		return nil
	}
	push("1", nil, at(wlRes(t, "w1", "10.0.0.1"), sum("a")), at(wlRes(t, "w2", "10.0.0.2"), sum("a")), at(wlRes(t, "w3", "10.0.0.3"), "7"))
	if want := map[string]string{"w1": sum("a"), "w2": sum("a"), "w3": "7"}; !reflect.DeepEqual(listed(), want) {
		t.Errorf("listed %v; want %v", listed(), want)
	}
	if v := c.versions[xdspb.AddressType]; len(v.sums) != 2 || len(v.strs) != 1 {
		t.Errorf("%d versions packed, %d not; want 2 and 1", len(v.sums), len(v.strs))
	}
	push("2", []string{"w3"}, at(wlRes(t, "w1", "10.0.0.1"), "8"), at(wlRes(t, "w2", "10.0.0.9"), sum("b")))
	if want := map[string]string{"w1": "8", "w2": sum("b")}; !reflect.DeepEqual(listed(), want) {
		t.Errorf("after a second push: listed %v; want %v", listed(), want)
	}
}
