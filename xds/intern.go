package xds

import (
	"slices"
	"strconv"
)

// interner shares equal values among the resources of one push: a mesh repeats namespaces,
// nodes, service accounts, canonical names, localities and service port maps across
// thousands of workloads, and the proto decoder allocates each occurrence anew. State
// values are immutable once built, so sharing is safe. A nil interner shares nothing.
type interner struct {
	strs  map[string]string
	pmaps map[string]map[uint16]uint16
	smaps map[string]map[string]map[uint16]uint16
	key   []byte
}

func newInterner() *interner {
	return &interner{strs: map[string]string{}, pmaps: map[string]map[uint16]uint16{}, smaps: map[string]map[string]map[uint16]uint16{}}
}

func (in *interner) str(s string) string {
	if in == nil || s == "" {
		return s
	}
	if v, ok := in.strs[s]; ok {
		return v
	}
	in.strs[s] = s
	return s
}

func (in *interner) portsKey(m map[uint16]uint16) []byte {
	ks := make([]uint16, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	for _, k := range ks {
		in.key = strconv.AppendUint(in.key, uint64(k), 10)
		in.key = append(in.key, ':')
		in.key = strconv.AppendUint(in.key, uint64(m[k]), 10)
		in.key = append(in.key, ',')
	}
	return in.key
}

// ports returns a map equal to m, shared with earlier ones of the push.
func (in *interner) ports(m map[uint16]uint16) map[uint16]uint16 {
	if in == nil {
		return m
	}
	k := in.portsKey(m)
	in.key = k[:0]
	if v, ok := in.pmaps[string(k)]; ok { // no allocation for the lookup
		return v
	}
	in.pmaps[string(k)] = m
	return m
}

// services returns a workload services map equal to m (its port maps already interned),
// shared with earlier workloads of the push: the endpoints of one service carry the same.
// The lookup allocates nothing; most workloads are in one service.
func (in *interner) services(m map[string]map[uint16]uint16) map[string]map[uint16]uint16 {
	if in == nil {
		return m
	}
	k := in.key[:0]
	appendSvc := func(svc string) {
		k = append(k, svc...)
		k = append(k, '=')
		in.key = k
		k = in.portsKey(m[svc])
		k = append(k, ';')
	}
	if len(m) == 1 {
		for svc := range m {
			appendSvc(svc)
		}
	} else {
		svcs := make([]string, 0, len(m))
		for svc := range m {
			svcs = append(svcs, svc)
		}
		slices.Sort(svcs)
		for _, svc := range svcs {
			appendSvc(svc)
		}
	}
	in.key = k[:0]
	if v, ok := in.smaps[string(k)]; ok {
		return v
	}
	in.smaps[string(k)] = m
	return m
}
