//go:build !linux

package attack

import "errors"

func confine(int, float64) (func(), error) {
	return nil, errors.New("attack: confining the attacker's CPU needs Linux cgroups")
}
