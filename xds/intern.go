package xds

import (
	"cmp"
	"encoding/binary"
	"fmt"
	"hash/maphash"
	"slices"
	"strconv"
	"strings"

	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// interner shares equal values among the resources of one push: a mesh repeats namespaces,
// nodes, service accounts, canonical names, localities and service port maps across
// thousands of workloads, and the proto decoder allocates each occurrence anew. State
// values are immutable once built, so sharing is safe. A nil interner shares nothing.
//
// A push's strings may alias its message (wire.go), which is freed as it is walked: a
// string the interner keeps, or hands out with own, is a copy.
type interner struct {
	strs  map[string]string
	pmaps map[string]map[uint16]uint16
	smaps map[string]map[string]map[uint16]uint16
	metas map[metaHash]*state.WorkloadMeta // by metaKey's hash
	key   []byte                           // scratch for lookup keys
	mkey  []byte                           // scratch for metaKey
	names []string                         // scratch for services
	pairs []portPair                       // scratch for services
}

func newInterner() *interner {
	return &interner{strs: map[string]string{}, pmaps: map[string]map[uint16]uint16{}, smaps: map[string]map[string]map[uint16]uint16{},
		metas: map[metaHash]*state.WorkloadMeta{}}
}

func (in *interner) str(s string) string {
	if in == nil || s == "" {
		return s
	}
	if v, ok := in.strs[s]; ok {
		return v
	}
	s = strings.Clone(s)
	in.strs[s] = s
	return s
}

// own is s, copied if it may alias the push's message (there is an interner).
func (in *interner) own(s string) string {
	if in == nil {
		return s
	}
	return strings.Clone(s)
}

// services converts a workload's services map (service key -> port list), shared with
// earlier workloads of the push that have the same: the endpoints of one service carry
// the same. Its key is built from the list itself, so a hit (most workloads) allocates
// nothing.
func (in *interner) services(ps map[string]*workloadpb.PortList) (map[string]map[uint16]uint16, error) {
	if in == nil {
		m := make(map[string]map[uint16]uint16, len(ps))
		for key, pl := range ps {
			ports, err := convertPorts(pl.GetPorts(), nil)
			if err != nil {
				return nil, fmt.Errorf("services[%q]: %w", key, err)
			}
			m[key] = ports
		}
		return m, nil
	}
	k, err := in.appendServices(in.key[:0], ps)
	if err != nil {
		return nil, err
	}
	in.key = k[:0]
	if v, ok := in.smaps[string(k)]; ok {
		return v, nil
	}
	key := string(k) // before portsOf reuses in.key
	m := make(map[string]map[uint16]uint16, len(ps))
	pairs := in.pairs[:0]
	for _, name := range in.names { // sorted by appendServices
		start := len(pairs)
		pairs, _ = appendPorts(pairs, ps[name].GetPorts()) // checked by appendServices
		m[in.str(name)] = in.portsOf(pairs[start:])
	}
	in.pairs = pairs[:0]
	in.smaps[key] = m
	return m, nil
}

// appendServices appends a services map's key to k: its service keys in order, each with
// its ports sorted (appendPorts). It leaves the keys sorted in in.names.
func (in *interner) appendServices(k []byte, ps map[string]*workloadpb.PortList) ([]byte, error) {
	names := in.names[:0]
	for name := range ps {
		names = append(names, name)
	}
	slices.Sort(names)
	in.names = names
	pairs := in.pairs[:0]
	var err error
	for _, name := range names {
		start := len(pairs)
		if pairs, err = appendPorts(pairs, ps[name].GetPorts()); err != nil {
			return k, fmt.Errorf("services[%q]: %w", name, err)
		}
		k = appendStr(k, name)
		k = appendPairs(k, pairs[start:])
		k = append(k, ';')
	}
	in.pairs = pairs[:0]
	return k, nil
}

// portPair is a port list's entry: service port -> target port.
type portPair struct{ svc, target uint16 }

// appendPorts appends ps's ports sorted by service port, a repeated service port keeping
// its last target port (as the map convertPorts builds does).
func appendPorts(dst []portPair, ps []*workloadpb.Port) ([]portPair, error) {
	start := len(dst)
	for _, p := range ps {
		sp, err := port16(p.GetServicePort(), "service_port")
		if err != nil {
			return dst, err
		}
		tp, err := port16(p.GetTargetPort(), "target_port")
		if err != nil {
			return dst, err
		}
		dst = append(dst, portPair{sp, tp})
	}
	list := dst[start:]
	slices.SortStableFunc(list, func(a, b portPair) int { return cmp.Compare(a.svc, b.svc) })
	out := list[:0]
	for i, p := range list {
		if i+1 == len(list) || list[i+1].svc != p.svc {
			out = append(out, p)
		}
	}
	return dst[:start+len(out)], nil
}

// appendPairs appends sorted pairs, a port map's interning key.
func appendPairs(k []byte, pairs []portPair) []byte {
	for _, p := range pairs {
		k = strconv.AppendUint(k, uint64(p.svc), 10)
		k = append(k, ':')
		k = strconv.AppendUint(k, uint64(p.target), 10)
		k = append(k, ',')
	}
	return k
}

// portsOf returns the port map of sorted pairs (appendPorts), shared with earlier ones of
// the push; a hit allocates nothing.
func (in *interner) portsOf(pairs []portPair) map[uint16]uint16 {
	var k []byte
	if in != nil {
		k = appendPairs(in.key[:0], pairs)
		in.key = k[:0]
		if v, ok := in.pmaps[string(k)]; ok {
			return v
		}
	}
	m := make(map[uint16]uint16, len(pairs))
	for _, p := range pairs {
		m[p.svc] = p.target
	}
	if in != nil {
		in.pmaps[string(k)] = m
	}
	return m
}

// metaKey is the key of the meta p converts to, built from p's own fields (their raw wire
// values: a meta is a function of them alone), valid until the next call; the metas are
// filed by its hash (metaHash). It lets a workload whose meta the push has seen skip
// converting and interning every one of its fields: with the resources in an order that
// does not keep a deployment's pods together (istiod's and go-control-plane's is map order)
// each of those lookups was a cache miss, and together they were a fifth of a 1M push
// (docs/PERFORMANCE.md, issue 59). ok is false when p has a port out of range (converting it
// reports that).
func (in *interner) metaKey(p *workloadpb.Workload) (key []byte, ok bool) {
	k := in.mkey[:0]
	for _, s := range [...]string{p.GetNamespace(), p.GetNetwork(), p.GetTrustDomain(), p.GetServiceAccount(),
		p.GetCanonicalName(), p.GetCanonicalRevision(), p.GetWorkloadName(), p.GetClusterId(),
		p.GetLocality().GetRegion(), p.GetLocality().GetZone(), p.GetLocality().GetSubzone()} {
		k = appendStr(k, s)
	}
	k = binary.AppendUvarint(k, uint64(len(p.GetAuthorizationPolicies())))
	for _, s := range p.GetAuthorizationPolicies() {
		k = appendStr(k, s)
	}
	k = appendWireGateway(k, p.GetWaypoint())
	k = appendWireGateway(k, p.GetNetworkGateway())
	if at := p.GetApplicationTunnel(); at != nil {
		k = append(k, 1)
		k = binary.AppendUvarint(k, uint64(uint32(at.GetProtocol())))
		k = binary.AppendUvarint(k, uint64(at.GetPort()))
	} else {
		k = append(k, 0)
	}
	var native byte
	if p.GetNativeTunnel() {
		native = 1
	}
	k = append(k, native)
	for _, e := range [...]int32{int32(p.GetTunnelProtocol()), int32(p.GetWorkloadType()), int32(p.GetNetworkMode())} {
		k = binary.AppendUvarint(k, uint64(uint32(e)))
	}
	k, err := in.appendServices(k, p.GetServices())
	in.mkey = k[:0]
	return k, err == nil
}

// appendWireGateway appends a GatewayAddress's fields that convertGateway reads.
func appendWireGateway(k []byte, g *workloadpb.GatewayAddress) []byte {
	if g == nil {
		return append(k, 0)
	}
	k = append(k, 1)
	k = binary.AppendUvarint(k, uint64(g.GetHboneMtlsPort()))
	switch d := g.GetDestination().(type) {
	case *workloadpb.GatewayAddress_Hostname:
		k = append(k, 1)
		k = appendStr(k, d.Hostname.GetNamespace())
		return appendStr(k, d.Hostname.GetHostname())
	case *workloadpb.GatewayAddress_Address:
		k = append(k, 2)
		k = appendStr(k, d.Address.GetNetwork())
		return appendStr(k, string(d.Address.GetAddress()))
	}
	return append(k, 0)
}

// meta returns *m as a meta of its own, its identity computed, filed under key (metaKey's
// hash) for the workloads of the push that follow. m must not be used afterwards.
func (in *interner) meta(m *state.WorkloadMeta, key metaHash) *state.WorkloadMeta {
	v := newMeta(m)
	if in == nil {
		return v
	}
	if len(m.AuthorizationPolicies) > 0 {
		v.AuthorizationPolicies = make([]string, len(m.AuthorizationPolicies))
		for i, s := range m.AuthorizationPolicies {
			v.AuthorizationPolicies[i] = in.str(s)
		}
	}
	in.metas[key] = v
	return v
}

// newMeta is a copy of *m with its identity computed: the one place a workload's identity
// is (once per meta, which the workloads of a deployment share within a push).
func newMeta(m *state.WorkloadMeta) *state.WorkloadMeta {
	v := new(state.WorkloadMeta)
	*v = *m
	v.CacheIdentity()
	return v
}

// metaHash is a meta key's hash under two random seeds, 128 bits. The metas are found by it
// rather than by the key itself: a key is 150 bytes or so, and comparing a stored one, cold
// when a deployment's pods come apart, was 7% of the node's samples in a 1M push in
// istiod's order (perf). Two keys hash alike by chance about once in 2^128 pairs, far below
// a flipped bit in memory; the seeds are the process's own, so a control plane cannot aim at
// one.
type metaHash [2]uint64

var metaSeeds = [2]maphash.Seed{maphash.MakeSeed(), maphash.MakeSeed()}

func hashMetaKey(k []byte) metaHash {
	return metaHash{maphash.Bytes(metaSeeds[0], k), maphash.Bytes(metaSeeds[1], k)}
}

// appendStr appends s length-prefixed, so adjacent strings cannot run together.
func appendStr(k []byte, s string) []byte {
	k = binary.AppendUvarint(k, uint64(len(s)))
	return append(k, s...)
}
