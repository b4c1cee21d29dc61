// The Python face of a handler extension: `registrations()` returns {FFI target name: handler
// capsule}, which dsv4_jax/native.py registers with XLA for the extension's platform.
#pragma once

#include <Python.h>

#include <cstddef>

namespace dsv4 {

struct Target {
  const char* name;
  void* handler;  // an XLA_FFI_DEFINE_HANDLER_SYMBOL function
};

template <size_t N>
PyObject* CapsuleDict(const Target (&targets)[N]) {
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  for (const Target& t : targets) {
    PyObject* capsule = PyCapsule_New(t.handler, nullptr, nullptr);
    if (capsule == nullptr || PyDict_SetItemString(out, t.name, capsule) != 0) {
      Py_XDECREF(capsule);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return out;
}

}  // namespace dsv4
