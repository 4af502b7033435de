package proxy

import (
	"encoding/binary"
	"net/netip"

	"github.com/gozt/gozt/identity"
)

// proxyV2Signature opens every PROXY protocol v2 header.
var proxyV2Signature = [12]byte{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A}

// tlvPeerIdentity carries the client's SPIFFE identity, as ztunnel writes it.
const tlvPeerIdentity = 0xD0

// proxyV2Header is the PROXY v2 header ztunnel sends to a workload's application tunnel:
// PROXY command over TCP, src = the client, dst = the HBONE target, and the client's
// identity in TLV 0xD0 when there is one. Mixed families are sent as IPv6.
func proxyV2Header(src, dst netip.AddrPort, peer identity.ID) []byte {
	s, d := src.Addr().Unmap(), dst.Addr().Unmap()
	v4 := s.Is4() && d.Is4()
	addrLen := 36
	fam := byte(0x21) // AF_INET6, STREAM
	if v4 {
		addrLen, fam = 12, 0x11
	}
	tlv := peer.String()
	n := addrLen
	if tlv != "" {
		n += 3 + len(tlv)
	}
	b := make([]byte, 0, 16+n)
	b = append(b, proxyV2Signature[:]...)
	b = append(b, 0x21, fam) // version 2, PROXY
	b = binary.BigEndian.AppendUint16(b, uint16(n))
	if v4 {
		s4, d4 := s.As4(), d.As4()
		b = append(b, s4[:]...)
		b = append(b, d4[:]...)
	} else {
		s16, d16 := s.As16(), d.As16()
		b = append(b, s16[:]...)
		b = append(b, d16[:]...)
	}
	b = binary.BigEndian.AppendUint16(b, src.Port())
	b = binary.BigEndian.AppendUint16(b, dst.Port())
	if tlv != "" {
		b = append(b, tlvPeerIdentity)
		b = binary.BigEndian.AppendUint16(b, uint16(len(tlv)))
		b = append(b, tlv...)
	}
	return b
}
