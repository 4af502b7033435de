package xds

import (
	"cmp"
	"encoding/binary"
	"fmt"
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
	smaps map[string]svcMap
	metas map[string]*state.WorkloadMeta
	key   []byte     // scratch for lookup keys
	names []string   // scratch for services
	pairs []portPair // scratch for services
}

// svcMap is an interned workload services map and its number in the push (from 1), which
// stands for it in a meta key.
type svcMap struct {
	m  map[string]map[uint16]uint16
	id uint32
}

func newInterner() *interner {
	return &interner{strs: map[string]string{}, pmaps: map[string]map[uint16]uint16{}, smaps: map[string]svcMap{},
		metas: map[string]*state.WorkloadMeta{}}
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
// nothing; the number is the map's in the push (0 with a nil interner).
func (in *interner) services(ps map[string]*workloadpb.PortList) (map[string]map[uint16]uint16, uint32, error) {
	if in == nil {
		m := make(map[string]map[uint16]uint16, len(ps))
		for key, pl := range ps {
			ports, err := convertPorts(pl.GetPorts(), nil)
			if err != nil {
				return nil, 0, fmt.Errorf("services[%q]: %w", key, err)
			}
			m[key] = ports
		}
		return m, 0, nil
	}
	names := in.names[:0]
	for name := range ps {
		names = append(names, name)
	}
	slices.Sort(names)
	k, pairs := in.key[:0], in.pairs[:0]
	var err error
	for _, name := range names {
		start := len(pairs)
		if pairs, err = appendPorts(pairs, ps[name].GetPorts()); err != nil {
			return nil, 0, fmt.Errorf("services[%q]: %w", name, err)
		}
		k = append(k, name...)
		k = append(k, '=')
		k = appendPairs(k, pairs[start:])
		k = append(k, ';')
	}
	in.key, in.names, in.pairs = k[:0], names[:0], pairs[:0]
	if v, ok := in.smaps[string(k)]; ok {
		return v.m, v.id, nil
	}
	key := string(k) // before portsOf reuses in.key
	m := make(map[string]map[uint16]uint16, len(names))
	pairs = pairs[:0]
	for _, name := range names {
		start := len(pairs)
		pairs, _ = appendPorts(pairs, ps[name].GetPorts()) // checked above
		m[in.str(name)] = in.portsOf(pairs[start:])
	}
	in.pairs = pairs[:0]
	id := uint32(len(in.smaps) + 1)
	in.smaps[key] = svcMap{m, id}
	return m, id, nil
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

// meta returns a meta equal to *m (svcs: its services map's number from services), shared
// with earlier workloads of the push, with its identity. *m is copied only when new, so a
// hit allocates nothing; m must not be used afterwards.
func (in *interner) meta(m *state.WorkloadMeta, svcs uint32) *state.WorkloadMeta {
	if in == nil {
		return newMeta(m)
	}
	k := in.key[:0]
	for _, s := range [...]string{m.Namespace, m.Network, m.TrustDomain, m.ServiceAccount,
		m.CanonicalName, m.CanonicalRevision, m.WorkloadName, m.ClusterID,
		m.Locality.Region, m.Locality.Zone, m.Locality.Subzone} {
		k = appendStr(k, s)
	}
	k = binary.AppendUvarint(k, uint64(len(m.AuthorizationPolicies)))
	for _, s := range m.AuthorizationPolicies {
		k = appendStr(k, s)
	}
	k = binary.AppendUvarint(k, uint64(svcs))
	k = appendGateway(k, m.Waypoint)
	k = appendGateway(k, m.NetworkGateway)
	if at := m.AppTunnel; at != nil {
		k = append(k, 1, byte(at.Protocol), byte(at.Port>>8), byte(at.Port))
	} else {
		k = append(k, 0)
	}
	var native byte
	if m.NativeTunnel {
		native = 1
	}
	k = append(k, byte(m.Protocol), byte(m.WorkloadType), byte(m.NetworkMode), native)
	in.key = k[:0]
	if v, ok := in.metas[string(k)]; ok {
		return v
	}
	v := newMeta(m)
	if len(m.AuthorizationPolicies) > 0 {
		v.AuthorizationPolicies = make([]string, len(m.AuthorizationPolicies))
		for i, s := range m.AuthorizationPolicies {
			v.AuthorizationPolicies[i] = in.str(s)
		}
	}
	in.metas[string(k)] = v
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

// appendStr appends s length-prefixed, so adjacent strings cannot run together.
func appendStr(k []byte, s string) []byte {
	k = binary.AppendUvarint(k, uint64(len(s)))
	return append(k, s...)
}

func appendGateway(k []byte, g *state.GatewayAddress) []byte {
	if g == nil {
		return append(k, 0)
	}
	k = append(k, 1, byte(g.HBONEPort>>8), byte(g.HBONEPort))
	k = appendStr(k, g.Network)
	n := len(k)
	k = append(k, 0)
	k, _ = g.Address.AppendBinary(k) // never fails; 0, 4 or 16+ bytes, so length-prefixed
	k[n] = byte(len(k) - n - 1)
	k = appendStr(k, g.Namespace)
	return appendStr(k, g.Hostname)
}
