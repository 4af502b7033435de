package xds

import (
	"reflect"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// TestInternedMetaMatchesPlain is the meta key's completeness guard: a workload converted
// through a push's interner, after one that differs from it in a single field (any leaf of
// wireSamples' fullest workload, a map key too), converts to what it converts to alone. A
// field the meta depends on but metaKey leaves out would hand the second workload the
// first one's meta. Workloads whose metas are equal share one.
func TestInternedMetaMatchesPlain(t *testing.T) {
	base := wireSamples()[4]
	variants := leafVariants(base)
	if len(variants) < 30 {
		t.Fatalf("only %d variants of the sample", len(variants))
	}
	for _, v := range variants {
		in := newInterner()
		first, err := convertWorkload(base, in)
		if err != nil {
			t.Fatal(err)
		}
		got, gerr := convertWorkload(v.w, in)
		want, werr := convertWorkload(v.w, nil)
		switch {
		case (gerr == nil) != (werr == nil) || gerr != nil && gerr.Error() != werr.Error():
			t.Errorf("%s: interned error %v, plain %v", v.path, gerr, werr)
		case gerr != nil:
		case !reflect.DeepEqual(got, want):
			t.Errorf("%s: interned\n%+v\nplain\n%+v", v.path, *got.WorkloadMeta, *want.WorkloadMeta)
		case reflect.DeepEqual(got.WorkloadMeta, first.WorkloadMeta) != (got.WorkloadMeta == first.WorkloadMeta):
			t.Errorf("%s: equal metas not shared, or a different one shared", v.path)
		}
	}
}

type variant struct {
	path string
	w    *workloadpb.Workload
}

// leafVariants is a copy of w for each scalar leaf it sets (and each map key), with that
// one value changed.
func leafVariants(w *workloadpb.Workload) []variant {
	var out []variant
	var walk func(path string, m protoreflect.Message, change func(func(protoreflect.Message)) *workloadpb.Workload)
	walk = func(path string, m protoreflect.Message, change func(func(protoreflect.Message)) *workloadpb.Workload) {
		m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
			p := path + "." + string(fd.Name())
			switch {
			case fd.IsMap():
				v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
					kp := p + "[" + k.String() + "]"
					out = append(out, variant{kp + " (key)", change(func(cm protoreflect.Message) {
						mp := cm.Mutable(fd).Map()
						val := mp.Get(k)
						mp.Clear(k)
						mp.Set(protoreflect.ValueOfString(k.String()+"2").MapKey(), val)
					})})
					if fd.MapValue().Message() != nil {
						walk(kp, mv.Message(), func(f func(protoreflect.Message)) *workloadpb.Workload {
							return change(func(cm protoreflect.Message) { f(cm.Mutable(fd).Map().Mutable(k).Message()) })
						})
					}
					return true
				})
			case fd.IsList():
				if fd.Message() != nil {
					walk(p+"[0]", v.List().Get(0).Message(), func(f func(protoreflect.Message)) *workloadpb.Workload {
						return change(func(cm protoreflect.Message) { f(cm.Mutable(fd).List().Get(0).Message()) })
					})
					break
				}
				out = append(out, variant{p + "[0]", change(func(cm protoreflect.Message) {
					l := cm.Mutable(fd).List()
					l.Set(0, changed(fd, l.Get(0)))
				})})
			case fd.Message() != nil:
				walk(p, v.Message(), func(f func(protoreflect.Message)) *workloadpb.Workload {
					return change(func(cm protoreflect.Message) { f(cm.Mutable(fd).Message()) })
				})
			default:
				out = append(out, variant{p, change(func(cm protoreflect.Message) { cm.Set(fd, changed(fd, cm.Get(fd))) })})
			}
			return true
		})
	}
	walk("", w.ProtoReflect(), func(f func(protoreflect.Message)) *workloadpb.Workload {
		c := proto.Clone(w).(*workloadpb.Workload)
		f(c.ProtoReflect())
		return c
	})
	return out
}

// changed is a value of fd's scalar kind other than v.
func changed(fd protoreflect.FieldDescriptor, v protoreflect.Value) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(!v.Bool())
	case protoreflect.EnumKind:
		vals := fd.Enum().Values()
		for i := range vals.Len() {
			if n := vals.Get(i).Number(); n != v.Enum() {
				return protoreflect.ValueOfEnum(n)
			}
		}
	case protoreflect.Uint32Kind:
		return protoreflect.ValueOfUint32(uint32(v.Uint()) + 1)
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(v.String() + "2")
	case protoreflect.BytesKind:
		b := append([]byte(nil), v.Bytes()...)
		b[len(b)-1]++
		return protoreflect.ValueOfBytes(b)
	}
	panic("no change for kind " + fd.Kind().String())
}
