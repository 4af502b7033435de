package capb_test

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/gozt/gozt/identity/ca/capb"
)

// TestMethodPath pins the gRPC path istiod serves (istio/api security/v1alpha1/ca.proto).
func TestMethodPath(t *testing.T) {
	const want = "/istio.v1.auth.IstioCertificateService/CreateCertificate"
	if got := capb.IstioCertificateService_CreateCertificate_FullMethodName; got != want {
		t.Fatalf("method path %q, want %q", got, want)
	}
}

// TestRequestWire checks each request field lands on istio/api's number and wire type:
// csr=1 (string), validity_duration=3 (varint), metadata=4 (google.protobuf.Struct).
func TestRequestWire(t *testing.T) {
	req := &capb.IstioCertificateRequest{
		Csr:              "-----BEGIN CERTIFICATE REQUEST-----",
		ValidityDuration: 86400,
		Metadata: &structpb.Struct{Fields: map[string]*structpb.Value{
			"ImpersonatedIdentity": structpb.NewStringValue("spiffe://td/ns/a/sa/b"),
		}},
	}
	b, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[protowire.Number]bool{}
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			t.Fatal(protowire.ParseError(n))
		}
		b = b[n:]
		switch num {
		case 1:
			v, m := protowire.ConsumeBytes(b)
			if typ != protowire.BytesType || m < 0 || string(v) != req.Csr {
				t.Fatalf("field 1 (csr): type %d, value %q", typ, v)
			}
			n = m
		case 3:
			v, m := protowire.ConsumeVarint(b)
			if typ != protowire.VarintType || m < 0 || v != 86400 {
				t.Fatalf("field 3 (validity_duration): type %d, value %d", typ, v)
			}
			n = m
		case 4:
			v, m := protowire.ConsumeBytes(b)
			if typ != protowire.BytesType || m < 0 {
				t.Fatalf("field 4 (metadata): type %d", typ)
			}
			var md structpb.Struct
			if err := proto.Unmarshal(v, &md); err != nil || md.Fields["ImpersonatedIdentity"].GetStringValue() != "spiffe://td/ns/a/sa/b" {
				t.Fatalf("field 4 (metadata) does not decode as the Struct sent: %v", err)
			}
			n = m
		default:
			t.Fatalf("unexpected field %d", num)
		}
		seen[num] = true
		b = b[n:]
	}
	if len(seen) != 3 {
		t.Fatalf("fields on the wire: %v, want 1, 3 and 4", seen)
	}
}

// TestResponseWire decodes a response encoded by hand as istiod sends it: cert_chain=1,
// repeated string, leaf first.
func TestResponseWire(t *testing.T) {
	var b []byte
	for _, pem := range []string{"leaf", "intermediate", "root"} {
		b = protowire.AppendTag(b, 1, protowire.BytesType)
		b = protowire.AppendString(b, pem)
	}
	var resp capb.IstioCertificateResponse
	if err := proto.Unmarshal(b, &resp); err != nil {
		t.Fatal(err)
	}
	if got := resp.GetCertChain(); len(got) != 3 || got[0] != "leaf" || got[2] != "root" {
		t.Fatalf("cert_chain = %q", got)
	}
}
