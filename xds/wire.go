package xds

import (
	"errors"
	"unicode/utf8"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// Decoding istio.workload.Workload without the proto runtime.
//
// A push of a million workloads is a million Address messages. proto.Unmarshal builds each
// as a fresh tree (about twenty allocations: the strings, the address slices, a services
// map and its port lists), which convertWorkload reads once and drops: at a million
// workloads that garbage and the collections it caused were most of the push's time
// (docs/PERFORMANCE.md). workloadDecoder fills one reused Workload instead, its strings and
// bytes aliasing the message, so decoding a workload allocates next to nothing; the
// converter copies what it keeps (interner.str, interner.own).
//
// It follows proto3's rules as proto.Unmarshal does: the last value of a scalar wins,
// repeated fields append, a message field seen twice is merged, a field of an unexpected
// wire type is skipped as unknown, strings must be UTF-8. Extensions, which the converter
// ignores, are skipped unread. wire_test.go compares it with proto.Unmarshal.

// Field numbers of istio.workload.Workload and the messages it holds.
const (
	wlName                  = 1
	wlNamespace             = 2
	wlAddresses             = 3
	wlNetwork               = 4
	wlTunnelProtocol        = 5
	wlTrustDomain           = 6
	wlServiceAccount        = 7
	wlWaypoint              = 8
	wlNode                  = 9
	wlCanonicalName         = 10
	wlCanonicalRevision     = 11
	wlWorkloadType          = 12
	wlWorkloadName          = 13
	wlNativeTunnel          = 14
	wlAuthorizationPolicies = 16
	wlStatus                = 17
	wlClusterID             = 18
	wlNetworkGateway        = 19
	wlUID                   = 20
	wlHostname              = 21
	wlServices              = 22
	wlApplicationTunnel     = 23
	wlLocality              = 24
	wlNetworkMode           = 25
	wlCapacity              = 27

	addrWorkload = 1 // istio.workload.Address
	addrService  = 2
)

// workloadDecoder decodes Workloads into one reused message. The zero value is ready.
type workloadDecoder struct {
	w        workloadpb.Workload
	services map[string]*workloadpb.PortList
	lists    pool[workloadpb.PortList]
	ports    pool[workloadpb.Port]
	locality workloadpb.Locality
	tunnel   workloadpb.ApplicationTunnel
	capacity wrapperspb.UInt32Value
}

// pool hands out reused messages; reset makes all of them available again.
type pool[T any] struct {
	all  []*T
	used int
}

func (p *pool[T]) get() *T {
	if p.used == len(p.all) {
		p.all = append(p.all, new(T))
	}
	m := p.all[p.used]
	p.used++
	return m
}

func (p *pool[T]) reset() { p.used = 0 }

// workload decodes an istio.workload.Address holding a workload, or returns ok false when
// the message is anything else (a service, or a workload the fast path does not take) for
// proto.Unmarshal to handle. The workload returned is valid until the next call and
// aliases b.
func (d *workloadDecoder) workload(b []byte) (w *workloadpb.Workload, ok bool, err error) {
	var body []byte
	seen := 0
	for len(b) > 0 {
		f, err := nextField(&b)
		if err != nil {
			return nil, false, err
		}
		switch f.num {
		case addrWorkload, addrService:
			if f.typ != protowire.BytesType {
				continue
			}
			if f.num == addrService {
				return nil, false, nil
			}
			body = f.bytes
			seen++
		}
	}
	if seen != 1 { // none (an error the slow path words), or parts to merge
		return nil, false, nil
	}
	if err := d.decode(body); err != nil {
		return nil, false, err
	}
	return &d.w, true, nil
}

// decode decodes one Workload message into d.w.
func (d *workloadDecoder) decode(b []byte) error {
	addrs, policies := d.w.Addresses[:0], d.w.AuthorizationPolicies[:0]
	d.w = workloadpb.Workload{}
	if d.services == nil {
		d.services = make(map[string]*workloadpb.PortList)
	}
	clear(d.services)
	d.lists.reset()
	d.ports.reset()
	w := &d.w
	var err error
	for len(b) > 0 && err == nil {
		var f field
		if f, err = nextField(&b); err != nil {
			break
		}
		if f.typ == protowire.VarintType {
			switch f.num {
			case wlTunnelProtocol:
				w.TunnelProtocol = workloadpb.TunnelProtocol(int32(f.varint))
			case wlWorkloadType:
				w.WorkloadType = workloadpb.WorkloadType(int32(f.varint))
			case wlNativeTunnel:
				w.NativeTunnel = f.varint != 0
			case wlStatus:
				w.Status = workloadpb.WorkloadStatus(int32(f.varint))
			case wlNetworkMode:
				w.NetworkMode = workloadpb.NetworkMode(int32(f.varint))
			}
			continue
		}
		if f.typ != protowire.BytesType {
			continue
		}
		v := f.bytes
		switch f.num {
		case wlUID:
			w.Uid, err = wireString(v)
		case wlName:
			w.Name, err = wireString(v)
		case wlNamespace:
			w.Namespace, err = wireString(v)
		case wlAddresses:
			addrs = append(addrs, v)
		case wlHostname:
			w.Hostname, err = wireString(v)
		case wlNetwork:
			w.Network, err = wireString(v)
		case wlTrustDomain:
			w.TrustDomain, err = wireString(v)
		case wlServiceAccount:
			w.ServiceAccount, err = wireString(v)
		case wlNode:
			w.Node, err = wireString(v)
		case wlCanonicalName:
			w.CanonicalName, err = wireString(v)
		case wlCanonicalRevision:
			w.CanonicalRevision, err = wireString(v)
		case wlWorkloadName:
			w.WorkloadName, err = wireString(v)
		case wlClusterID:
			w.ClusterId, err = wireString(v)
		case wlAuthorizationPolicies:
			var s string
			s, err = wireString(v)
			policies = append(policies, s)
		case wlWaypoint:
			if w.Waypoint == nil {
				w.Waypoint = new(workloadpb.GatewayAddress)
			}
			err = decodeGateway(v, w.Waypoint)
		case wlNetworkGateway:
			if w.NetworkGateway == nil {
				w.NetworkGateway = new(workloadpb.GatewayAddress)
			}
			err = decodeGateway(v, w.NetworkGateway)
		case wlServices:
			err = d.decodeService(v)
		case wlApplicationTunnel:
			if w.ApplicationTunnel == nil {
				d.tunnel = workloadpb.ApplicationTunnel{}
				w.ApplicationTunnel = &d.tunnel
			}
			err = eachVarint(v, func(num protowire.Number, x uint64) {
				switch num {
				case 1:
					w.ApplicationTunnel.Protocol = workloadpb.ApplicationTunnel_Protocol(int32(x))
				case 2:
					w.ApplicationTunnel.Port = uint32(x)
				}
			})
		case wlLocality:
			if w.Locality == nil {
				d.locality = workloadpb.Locality{}
				w.Locality = &d.locality
			}
			err = decodeLocality(v, w.Locality)
		case wlCapacity:
			if w.Capacity == nil {
				d.capacity = wrapperspb.UInt32Value{}
				w.Capacity = &d.capacity
			}
			err = eachVarint(v, func(num protowire.Number, x uint64) {
				if num == 1 {
					w.Capacity.Value = uint32(x)
				}
			})
		}
	}
	if err != nil {
		return err
	}
	if len(addrs) > 0 {
		w.Addresses = addrs
	}
	if len(policies) > 0 {
		w.AuthorizationPolicies = policies
	}
	if len(d.services) > 0 {
		w.Services = d.services
	}
	return nil
}

// decodeService decodes one entry of the services map (key 1, value 2 a PortList).
func (d *workloadDecoder) decodeService(b []byte) error {
	var key string
	list := d.lists.get() // a value seen twice is merged; none is an empty list
	list.Ports = list.Ports[:0]
	for len(b) > 0 {
		f, err := nextField(&b)
		if err != nil {
			return err
		}
		if f.typ != protowire.BytesType {
			continue
		}
		switch f.num {
		case 1:
			if key, err = wireString(f.bytes); err != nil {
				return err
			}
		case 2:
			if err := d.decodePortList(f.bytes, list); err != nil {
				return err
			}
		}
	}
	if len(list.Ports) == 0 {
		list.Ports = nil
	}
	d.services[key] = list
	return nil
}

func (d *workloadDecoder) decodePortList(b []byte, list *workloadpb.PortList) error {
	for len(b) > 0 {
		f, err := nextField(&b)
		if err != nil {
			return err
		}
		if f.num != 1 || f.typ != protowire.BytesType {
			continue
		}
		p := d.ports.get()
		p.ServicePort, p.TargetPort, p.AppProtocol = 0, 0, 0
		if err := eachVarint(f.bytes, func(num protowire.Number, x uint64) {
			switch num {
			case 1:
				p.ServicePort = uint32(x)
			case 2:
				p.TargetPort = uint32(x)
			case 3:
				p.AppProtocol = workloadpb.AppProtocol(int32(x))
			}
		}); err != nil {
			return err
		}
		list.Ports = append(list.Ports, p)
	}
	return nil
}

// decodeGateway merges a GatewayAddress into g. It is allocated (a waypoint or a network
// gateway is on a few workloads), so it may alias b only through its strings and bytes.
func decodeGateway(b []byte, g *workloadpb.GatewayAddress) error {
	for len(b) > 0 {
		f, err := nextField(&b)
		if err != nil {
			return err
		}
		switch {
		case f.num == 3 && f.typ == protowire.VarintType:
			g.HboneMtlsPort = uint32(f.varint)
		case f.num == 1 && f.typ == protowire.BytesType:
			h, ok := g.Destination.(*workloadpb.GatewayAddress_Hostname)
			if !ok {
				h = &workloadpb.GatewayAddress_Hostname{Hostname: new(workloadpb.NamespacedHostname)}
				g.Destination = h
			}
			if err := eachString(f.bytes, 2, func(num protowire.Number, s string) {
				switch num {
				case 1:
					h.Hostname.Namespace = s
				case 2:
					h.Hostname.Hostname = s
				}
			}); err != nil {
				return err
			}
		case f.num == 2 && f.typ == protowire.BytesType:
			a, ok := g.Destination.(*workloadpb.GatewayAddress_Address)
			if !ok {
				a = &workloadpb.GatewayAddress_Address{Address: new(workloadpb.NetworkAddress)}
				g.Destination = a
			}
			if err := decodeNetworkAddress(f.bytes, a.Address); err != nil {
				return err
			}
		}
	}
	return nil
}

func decodeNetworkAddress(b []byte, a *workloadpb.NetworkAddress) error {
	for len(b) > 0 {
		f, err := nextField(&b)
		if err != nil {
			return err
		}
		switch {
		case f.num == 1 && f.typ == protowire.BytesType:
			if a.Network, err = wireString(f.bytes); err != nil {
				return err
			}
		case f.num == 2 && f.typ == protowire.BytesType:
			a.Address = f.bytes
		case f.num == 3 && f.typ == protowire.VarintType:
			n := uint32(f.varint)
			a.Length = &n
		}
	}
	return nil
}

func decodeLocality(b []byte, l *workloadpb.Locality) error {
	return eachString(b, 3, func(num protowire.Number, s string) {
		switch num {
		case 1:
			l.Region = s
		case 2:
			l.Zone = s
		case 3:
			l.Subzone = s
		}
	})
}

// field is one field of a message: its number and wire type, and its value for the two
// types the decoders read (others are skipped).
type field struct {
	num    protowire.Number
	typ    protowire.Type
	varint uint64
	bytes  []byte
}

// nextField consumes the next field of *b.
func nextField(b *[]byte) (field, error) {
	num, typ, n := protowire.ConsumeTag(*b)
	if n < 0 {
		return field{}, protowire.ParseError(n)
	}
	*b = (*b)[n:]
	f := field{num: num, typ: typ}
	switch typ {
	case protowire.VarintType:
		f.varint, n = protowire.ConsumeVarint(*b)
	case protowire.BytesType:
		f.bytes, n = protowire.ConsumeBytes(*b)
	default:
		n = protowire.ConsumeFieldValue(num, typ, *b)
	}
	if n < 0 {
		return field{}, protowire.ParseError(n)
	}
	*b = (*b)[n:]
	return f, nil
}

// eachVarint calls f for each varint field of the message in b.
func eachVarint(b []byte, f func(protowire.Number, uint64)) error {
	for len(b) > 0 {
		fl, err := nextField(&b)
		if err != nil {
			return err
		}
		if fl.typ == protowire.VarintType {
			f(fl.num, fl.varint)
		}
	}
	return nil
}

// eachString calls f for each of the fields 1 to last of the message in b, all strings.
func eachString(b []byte, last protowire.Number, f func(protowire.Number, string)) error {
	for len(b) > 0 {
		fl, err := nextField(&b)
		if err != nil {
			return err
		}
		if fl.typ != protowire.BytesType || fl.num < 1 || fl.num > last {
			continue
		}
		s, err := wireString(fl.bytes)
		if err != nil {
			return err
		}
		f(fl.num, s)
	}
	return nil
}

var errUTF8 = errors.New("string field contains invalid UTF-8")

// wireString is b as a string without a copy (aliasString), checked to be UTF-8.
func wireString(b []byte) (string, error) {
	if !utf8.Valid(b) {
		return "", errUTF8
	}
	return aliasString(b), nil
}

// aliasString is b as a string without a copy: valid while b's buffer is, which is why
// whatever decoding keeps is copied (interner.str, interner.own, decoded.add).
func aliasString(b []byte) string { return unsafe.String(unsafe.SliceData(b), len(b)) }
