//go:build !race

package hbone

const raceEnabled = false
