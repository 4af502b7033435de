package xds

import (
	"errors"
	"fmt"
	"runtime"
	"time"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
)

// Streaming decode of DeltaDiscoveryResponse.
//
// gRPC hands a codec the whole received message as a list of buffers (the HTTP/2 DATA
// frames' payloads, 16 KiB each by default). The proto codec would materialise it as a
// DeltaDiscoveryResponse (every Resource and its Any's bytes copied), the client would then
// convert it into state values: at the end of a 1M-workload push the node held the raw
// 350 MB message, its 500 MB proto tree and the converted state at once. streamCodec
// instead walks the wire format of the buffers, converts each Resource as it reaches it
// and frees the buffers behind it, so the raw message shrinks while the state grows and no
// proto tree of the whole push exists.

// Field numbers of envoy.service.discovery.v3.DeltaDiscoveryResponse and Resource.
const (
	respSystemVersion = 1
	respResources     = 2
	respTypeURL       = 4
	respNonce         = 5
	respRemoved       = 6

	resVersion  = 1
	resResource = 2
	resName     = 3
	resAliases  = 4

	anyTypeURL = 1
	anyValue   = 2
)

// yieldEvery is how long decode converts between yields to the scheduler. A yield is not
// free (it wakes another thread to look for work): one every 64 resources slowed a big
// push by a seventh (docs/PERFORMANCE.md, "A node at scale").
const yieldEvery = time.Millisecond

// response is a DeltaDiscoveryResponse decoded by streamCodec: its scalar fields and its
// resources already converted.
type response struct {
	collectNames bool         // fill d.names (on-demand waiters need them)
	held         *state.Store // if set, resources it holds with the same bytes are not converted again
	typeURL      string
	nonce        string
	removed      []string
	bytes        int
	d            *decoded
}

// streamCodec is gRPC's proto codec, except that a *response is decoded as it is walked.
type streamCodec struct{ proto encoding.CodecV2 }

func newStreamCodec() streamCodec { return streamCodec{proto: encoding.GetCodecV2("proto")} }

func (c streamCodec) Name() string { return c.proto.Name() }

func (c streamCodec) Marshal(v any) (mem.BufferSlice, error) { return c.proto.Marshal(v) }

func (c streamCodec) Unmarshal(data mem.BufferSlice, v any) error {
	r, ok := v.(*response)
	if !ok {
		return c.proto.Unmarshal(data, v)
	}
	return r.decode(data)
}

// wireReader reads protobuf wire format across the buffers of a mem.BufferSlice. A field
// inside one buffer is returned in place; one spanning buffers is copied to scratch.
type wireReader struct {
	data    mem.BufferSlice
	bufs    [][]byte
	ci, off int // current buffer and offset in it
	freed   int // buffers before this index are freed
	scratch []byte
	left    int // bytes not yet read
}

func newWireReader(data mem.BufferSlice) *wireReader {
	r := &wireReader{data: data, bufs: make([][]byte, len(data)), left: data.Len()}
	for i, b := range data {
		r.bufs[i] = b.ReadOnlyData()
	}
	return r
}

func (r *wireReader) normalize() {
	for r.ci < len(r.bufs) && r.off == len(r.bufs[r.ci]) {
		r.ci++
		r.off = 0
	}
}

// bytes returns the next n bytes, valid until the next call.
func (r *wireReader) bytes(n int) ([]byte, error) {
	if n < 0 || n > r.left {
		return nil, errors.New("truncated message")
	}
	r.left -= n
	r.normalize()
	if n == 0 {
		return nil, nil
	}
	if b := r.bufs[r.ci]; len(b)-r.off >= n {
		out := b[r.off : r.off+n]
		r.off += n
		return out, nil
	}
	if cap(r.scratch) < n {
		r.scratch = make([]byte, n)
	}
	out := r.scratch[:n]
	for c := 0; c < n; {
		r.normalize()
		k := copy(out[c:], r.bufs[r.ci][r.off:])
		r.off += k
		c += k
	}
	return out, nil
}

func (r *wireReader) varint() (uint64, error) {
	var v uint64
	for shift := uint(0); shift < 64; shift += 7 {
		b, err := r.bytes(1)
		if err != nil {
			return 0, err
		}
		v |= uint64(b[0]&0x7f) << shift
		if b[0] < 0x80 {
			return v, nil
		}
	}
	return 0, errors.New("varint overflows")
}

// field reads one field's tag and, for a length-delimited field, its bytes; other wire
// types are skipped (and reported with b nil).
func (r *wireReader) field() (num protowire.Number, typ protowire.Type, b []byte, err error) {
	tag, err := r.varint()
	if err != nil {
		return 0, 0, nil, err
	}
	num, typ = protowire.Number(tag>>3), protowire.Type(tag&7)
	switch typ {
	case protowire.VarintType:
		_, err = r.varint()
	case protowire.Fixed32Type:
		_, err = r.bytes(4)
	case protowire.Fixed64Type:
		_, err = r.bytes(8)
	case protowire.BytesType:
		var n uint64
		if n, err = r.varint(); err == nil {
			if n > uint64(r.left) {
				return 0, 0, nil, errors.New("truncated message")
			}
			b, err = r.bytes(int(n))
		}
	default:
		err = fmt.Errorf("unsupported wire type %d", typ)
	}
	return num, typ, b, err
}

// release drops the buffers wholly read: each slot is emptied (gRPC frees the slice after
// Unmarshal returns, and SliceBuffer's Free does nothing), and the buffer is not handed
// back to gRPC's pool but left to the collector, so a GC reclaims it at once rather than
// after a pool's two-cycle victim delay (a 1M push is 23,000 buffers).
func (r *wireReader) release() {
	for ; r.freed < r.ci; r.freed++ {
		r.data[r.freed] = mem.SliceBuffer(nil)
		r.bufs[r.freed] = nil
	}
}

// decode reads the message twice: once for its scalar fields, skipping the resources (the
// type URL, which says how to convert them, may follow them on the wire), then converting
// the resources in order and freeing each buffer once past it.
func (resp *response) decode(data mem.BufferSlice) error {
	resp.bytes = data.Len()
	r := newWireReader(data)
	var resources, removed int
	for r.left > 0 {
		num, typ, b, err := r.field()
		if err != nil {
			return err
		}
		if typ != protowire.BytesType {
			continue
		}
		switch num {
		case respTypeURL:
			resp.typeURL = string(b)
		case respNonce:
			resp.nonce = string(b)
		case respResources:
			resources++
		case respRemoved:
			removed++
		}
	}
	resp.removed = make([]string, 0, removed)
	resp.d = newDecoded(resp.collectNames, resp.held)
	// Sized once: grown by appending, a 1M push's lists left ~100 MB of garbage behind.
	resp.d.accepted = make([]nameVersion, 0, resources)
	if resp.typeURL == xdspb.AddressType {
		resp.d.batch.Workloads = make([]*state.Workload, 0, resources)
	}
	r = newWireReader(data)
	var res discoverypb.Resource
	var body anypb.Any
	converted, yielded := 0, time.Now()
	for r.left > 0 {
		num, typ, b, err := r.field()
		if err != nil {
			return err
		}
		if typ != protowire.BytesType {
			continue
		}
		switch num {
		case respResources:
			if err := parseResource(b, &res, &body); err != nil {
				return fmt.Errorf("resources: %w", err)
			}
			resp.d.add(resp.typeURL, &res)
			if converted++; converted%64 == 0 && time.Since(yielded) >= yieldEvery {
				// A big push is seconds of CPU on this goroutine: let the connections
				// queued behind it on this P run now, not at the next preemption (10 ms).
				runtime.Gosched()
				yielded = time.Now()
			}
		case respRemoved:
			resp.removed = append(resp.removed, string(b))
		}
		r.release()
	}
	resp.d.removed(resp.typeURL, resp.removed)
	return nil
}

// parseResource decodes a Resource without copying: its name and version and its body's
// type URL and value alias b (decoded.add copies what it keeps).
func parseResource(b []byte, res *discoverypb.Resource, body *anypb.Any) error {
	res.Name, res.Version, res.Aliases, res.Resource = "", "", nil, nil
	body.TypeUrl, body.Value = "", nil
	for len(b) > 0 {
		num, v, rest, err := nextBytes(b)
		if err != nil {
			return err
		}
		b = rest
		switch num {
		case resName:
			res.Name = aliasString(v)
		case resVersion:
			res.Version = aliasString(v)
		case resAliases:
			res.Aliases = append(res.Aliases, string(v))
		case resResource:
			for len(v) > 0 {
				anum, av, arest, err := nextBytes(v)
				if err != nil {
					return err
				}
				v = arest
				switch anum {
				case anyTypeURL:
					body.TypeUrl = aliasString(av)
				case anyValue:
					body.Value = av
				}
			}
			res.Resource = body
		}
	}
	return nil
}

// nextBytes returns the next length-delimited field of the message in b (its number and
// value) and what follows it, skipping fields of other wire types on the way; num is 0 when
// b held no such field.
func nextBytes(b []byte) (num protowire.Number, v, rest []byte, err error) {
	for len(b) > 0 {
		f, err := nextField(&b)
		if err != nil {
			return 0, nil, nil, err
		}
		if f.typ == protowire.BytesType {
			return f.num, f.bytes, b, nil
		}
	}
	return 0, nil, nil, nil
}

// fromProto is a response from a materialised DeltaDiscoveryResponse (tests, benchmarks).
func fromProto(m *discoverypb.DeltaDiscoveryResponse, collectNames bool, held *state.Store) *response {
	resp := &response{collectNames: collectNames, held: held, typeURL: m.GetTypeUrl(), nonce: m.GetNonce(), removed: m.GetRemovedResources(), bytes: proto.Size(m)}
	resp.d = newDecoded(collectNames, held)
	for _, r := range m.GetResources() {
		resp.d.add(resp.typeURL, r)
	}
	resp.d.removed(resp.typeURL, resp.removed)
	return resp
}
