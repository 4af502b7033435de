package xds

import "encoding/hex"

// versionMap is the version of each resource of one type the client holds, by name: what it
// lists to the server on a reconnect (initial_resource_versions). A version of 64 lowercase
// hex digits (go-control-plane versions every resource by the SHA-256 of its bytes) is kept
// as its 32 bytes in the map's slot rather than as a 64-byte string of its own: at 1M
// resources 48 MB less held and a million fewer objects for the collector to mark (issue 59).
type versionMap struct {
	strs map[string]string
	sums map[string]sha256Hex
}

// sha256Hex is a version of 64 lowercase hex digits, decoded.
type sha256Hex [32]byte

// packVersion returns v's bytes as a string of 32 bytes if v is 64 lowercase hex digits (a
// string of them re-encodes to v), v itself otherwise.
func packVersion(v string) (s string, packed bool) {
	if len(v) != 64 {
		return v, false
	}
	for i := range len(v) {
		if c := v[i]; (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return v, false
		}
	}
	var sum sha256Hex
	hex.Decode(sum[:], []byte(v)) // checked above
	return string(sum[:]), true
}

func (m *versionMap) len() int { return len(m.strs) + len(m.sums) }

// setAll records accepted resources at their versions, with room made once for the first
// push's (a map grown a key at a time doubles its table twenty times at 1M).
func (m *versionMap) setAll(accepted []nameVersion) {
	if m.len() == 0 {
		packed := 0
		for _, a := range accepted {
			if a.packed {
				packed++
			}
		}
		m.strs, m.sums = make(map[string]string, len(accepted)-packed), make(map[string]sha256Hex, packed)
	}
	for _, a := range accepted {
		if a.packed {
			delete(m.strs, a.name)
			m.sums[a.name] = sha256Hex([]byte(a.version))
		} else {
			delete(m.sums, a.name)
			m.strs[a.name] = a.version
		}
	}
}

// remove forgets names, and rebuilds the maps at their length if more went than are left (a
// Go map does not shrink).
func (m *versionMap) remove(names []string) {
	for _, name := range names {
		delete(m.strs, name)
		delete(m.sums, name)
	}
	if len(names) > m.len() {
		strs, sums := make(map[string]string, len(m.strs)), make(map[string]sha256Hex, len(m.sums))
		for k, v := range m.strs {
			strs[k] = v
		}
		for k, v := range m.sums {
			sums[k] = v
		}
		m.strs, m.sums = strs, sums
	}
}

// all returns every name's version as the server sent it.
func (m *versionMap) all() map[string]string {
	out := make(map[string]string, m.len())
	for k, v := range m.strs {
		out[k] = v
	}
	for k, v := range m.sums {
		out[k] = hex.EncodeToString(v[:])
	}
	return out
}
