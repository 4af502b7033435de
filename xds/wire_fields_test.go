package xds

import (
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// wireIgnored are the Workload fields the wire decoder skips on purpose, with why.
var wireIgnored = map[protoreflect.Name]string{
	"extensions": "the converter reads none; skipped unread (decodeBoth drops them from proto.Unmarshal's result too)",
}

// TestWorkloadWireDecodesEveryField is the hand-written decoder's completeness guard: for
// every field of istio.workload.Workload, as the generated code describes it, a workload
// with only that field set (messages filled to the leaves, every list and map with one
// entry) decodes to what proto.Unmarshal gives, unless the field is on wireIgnored. A
// field added to Istio's proto and regenerated into xdspb fails here until wire.go decodes
// it or says why not, instead of being dropped silently.
func TestWorkloadWireDecodesEveryField(t *testing.T) {
	var d workloadDecoder
	fields := (&workloadpb.Workload{}).ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if _, ok := wireIgnored[fd.Name()]; ok {
			continue
		}
		w := &workloadpb.Workload{}
		m := w.ProtoReflect()
		setField(m, fd, 0)
		b := marshalAddress(t, w)
		want, got, protoErr, wireErr, ok := decodeBoth(t, &d, b)
		switch {
		case protoErr != nil || wireErr != nil || !ok:
			t.Errorf("field %s (%d): proto.Unmarshal %v, wire decoder %v (handled %v)", fd.Name(), fd.Number(), protoErr, wireErr, ok)
		case !proto.Equal(want, got):
			t.Errorf("field %s (%d) is not decoded by wire.go: got %v, want %v; decode it or add it to wireIgnored with why", fd.Name(), fd.Number(), got, want)
		}
	}
	for name := range wireIgnored {
		if fields.ByName(name) == nil {
			t.Errorf("wireIgnored names %s, which Workload no longer has", name)
		}
	}
}

// setField sets fd of m to a value other than its default: messages with every field set
// (down to a few levels), lists and maps with one entry.
func setField(m protoreflect.Message, fd protoreflect.FieldDescriptor, depth int) {
	switch {
	case fd.IsMap():
		mp := m.Mutable(fd).Map()
		mp.Set(scalarValue(fd.MapKey()).MapKey(), elemValue(mp.NewValue, fd.MapValue(), depth))
	case fd.IsList():
		l := m.Mutable(fd).List()
		l.Append(elemValue(l.NewElement, fd, depth))
	case fd.Message() != nil:
		fill(m.Mutable(fd).Message(), depth+1)
	default:
		m.Set(fd, scalarValue(fd))
	}
}

// elemValue is a list element or map value of fd's kind: a filled message, or a scalar.
func elemValue(newMsg func() protoreflect.Value, fd protoreflect.FieldDescriptor, depth int) protoreflect.Value {
	if fd.Message() == nil {
		return scalarValue(fd)
	}
	v := newMsg()
	fill(v.Message(), depth+1)
	return v
}

// fill sets every field of m (one member of each oneof), down to depth 4.
func fill(m protoreflect.Message, depth int) {
	if depth > 4 {
		return
	}
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if o := fd.ContainingOneof(); o != nil && !o.IsSynthetic() && m.WhichOneof(o) != nil {
			continue
		}
		setField(m, fd, depth)
	}
}

// scalarValue is a value of fd's scalar kind other than the default.
func scalarValue(fd protoreflect.FieldDescriptor) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.EnumKind:
		vals := fd.Enum().Values()
		return protoreflect.ValueOfEnum(vals.Get(vals.Len() - 1).Number())
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(7)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(7)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(7)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(7)
	case protoreflect.FloatKind:
		return protoreflect.ValueOfFloat32(7)
	case protoreflect.DoubleKind:
		return protoreflect.ValueOfFloat64(7)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("x")
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte{10, 0, 0, 7})
	}
	panic("unknown kind " + fd.Kind().String())
}
